"""The multiple-choice knapsack as an ILP, solved by CBC through PuLP (3.x and 4.x).

One CBC model per group (pipeline stage, or the whole model): the groups share no variable and the
global budget follows from the per-stage ones, so they are independent problems, and several small
models prove optimality far faster than one big one (a 126-layer time-model case with 9 stages: ~0.3 s
of CPU instead of no proof in 10 s). They run in parallel threads (CBC is a subprocess).

Real layouts repeat one layer shape, so whole classes of linears (every qkv, every fc1, ...) carry
the same budget weights, and a model with one binary per layer and choice lets CBC search all the
equally good ways of spreading the same upgrades over a class (126 layers, three precisions, one
budget: 4-10 s, often no proof). The counted model instead gives each class and choice i one
integer, how many of its layers sit at choice i or above, and makes the layers' own variables
continuous. That is exact: in one-hot form (x_ji = layer j at choice i) the rows "each layer at most
one choice" and "n_i layers at choice i" are a bipartite transportation system, totally unimodular,
so for integral counts every vertex is integral; the cumulative variables (y_ji = x_ji + x_j,i+1 +
...) and counts are a unimodular change of those, so the same holds. The LP thus puts the counts on
the class's cheapest layers, and CBC branches on a few counts only (the same case: ~0.1 s). The
cumulative form branches better than the one-hot one (3-4x less CBC time on the time model).
"""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

from snip_megatron.planner.config import PlannerConfig
from snip_megatron.planner.exact import integer_units
from snip_megatron.planner.problem import Knapsack


# How far a continuous choice variable may sit from 0 or 1 (counted model) and still be read.
INTEGRAL_TOL = 1e-6
# CBC's cutoff increment for the counted model, in normalised cost units (see _cbc_command).
CUTOFF_INCREMENT = 1e-9
CBC_MISSING = "CBC not found (PuLP >= 4 needs `pip install pulp[cbc]`, or set PlannerConfig.cbc_path)"


class SolverUnavailable(RuntimeError):
    """CBC (or PuLP) cannot be used here; the caller falls back to the exact solver."""


class SolverFailed(RuntimeError):
    """CBC ran but returned no usable answer."""


def _cbc_command(config: PlannerConfig, time_limit_s: float | None = None):
    """A PuLP COIN_CMD for the CBC binary to use, or None when there is none.

    PuLP < 4 bundles CBC (we point COIN_CMD at that binary rather than using the deprecated
    PULP_CBC_CMD); PuLP >= 4 finds it through the `cbcbox` wheel (`pulp[cbc]`) or PATH."""
    try:
        import pulp
    except Exception:
        return None
    path = config.cbc_path
    if path is None:  # compat: PuLP 3 (Python 3.11, the compat lane) bundles CBC; PuLP 4 has cbcbox
        bundled = getattr(getattr(pulp, "PULP_CBC_CMD", None), "pulp_cbc_path", None)
        if bundled and os.path.isfile(bundled):
            path = bundled
    kwargs = dict(msg=False, timeLimit=time_limit_s or config.time_limit_s, gapRel=config.gap_rel)
    if config.aggregate_layers:
        # The counted model's integers are a few counts in one knapsack row: CBC's root cut passes
        # barely move its bound and cost ~40% of its CPU on bench/planner_scale.py.
        kwargs["cuts"] = False
        # CBC derives a cutoff increment from the objective and then ignores better plans closer
        # than that (seen: 5e-6 of the cost above the optimum, reported "optimal"). Costs are
        # normalised to <= 1, so a tiny increment keeps only round-off between CBC and the optimum.
        kwargs["options"] = [f"increment {CUTOFF_INCREMENT:g}"]
    if config.threads is not None:
        kwargs["threads"] = config.threads
    try:
        cmd = pulp.COIN_CMD(path=path, **kwargs)
        return cmd if cmd.available() else None
    except Exception:
        return None


def cbc_available(config: PlannerConfig | None = None) -> bool:
    """Whether solve_ilp can run CBC with this config."""
    return _cbc_command(config or PlannerConfig()) is not None


def describe_cbc(config: PlannerConfig | None = None) -> str | None:
    """"CBC <version> at <path> (PuLP <version>[, cbcbox <version>])" for the binary solve_ilp
    would run; None without one."""
    cmd = _cbc_command(config or PlannerConfig())
    if cmd is None:
        return None
    import pulp

    path = os.path.normpath(cmd.path)
    packages = [f"PuLP {pulp.__version__}"]
    if f"{os.sep}cbcbox{os.sep}" in path:  # PuLP >= 4's CBC comes from the cbcbox wheel
        try:
            packages.append(f"cbcbox {metadata.version('cbcbox')}")
        except Exception:
            pass
    return f"CBC {_cbc_version(path)} at {path} ({', '.join(packages)})"


@functools.lru_cache(maxsize=8)
def _cbc_version(path: str) -> str:
    try:
        banner = subprocess.run([path, "-quit"], capture_output=True, text=True, timeout=10).stdout
    except Exception:
        return "(version unknown)"
    return cbc_banner_version(banner)


def cbc_banner_version(banner: str) -> str:
    """The version in what `cbc -quit` prints: "Version: 2.10.3" (the binary PuLP 3 bundles),
    "Version: Devel (unstable)" (cbcbox 2.929, PuLP 4.2's) or a first line "CBC devel (git:146ce89) —
    COIN-OR Branch and Cut" (cbcbox's later builds)."""
    found = re.search(r"Version:\s*(\S+)", banner) or re.match(r"\s*CBC\s+(.+?)\s+\W\s+COIN-OR", banner)
    return found.group(1) if found else "(version unknown)"


def solve_ilp(ks: Knapsack, config: PlannerConfig) -> tuple[list[int], str]:
    """Choice indices (one per free layer) and status "optimal" or "feasible (...)" (a group stopped
    early with an incumbent). Raises SolverUnavailable or SolverFailed, nothing else."""
    if not ks.free:
        return [], "optimal"
    if _cbc_command(config) is None:
        raise SolverUnavailable(CBC_MISSING)
    deadline = time.monotonic() + config.time_limit_s
    groups = [[j for j, gj in enumerate(ks.group) if gj == g] for g in range(len(ks.need))]

    def run(g: int) -> tuple[list[int], str]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SolverFailed(f"CBC ran out of its {config.time_limit_s} s before pipeline group {g}")
        return _solve_group(ks, groups[g], ks.need[g], config, left)

    # CBC runs as a subprocess, so threads overlap the stages' solves on a multi-core host.
    workers = max(1, min(len(groups), os.cpu_count() or 1))
    if workers == 1:
        results = [run(g) for g in range(len(groups))]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="snip-cbc") as pool:
            results = list(pool.map(run, range(len(groups))))
    picks = [0] * len(ks.free)
    status = "optimal"
    for members, (sub, sub_status) in zip(groups, results):
        for j, i in zip(members, sub):
            picks[j] = i
        if sub_status != "optimal":
            status = sub_status
    if not ks.feasible(picks):  # integral but outside CBC's tolerance of the budget
        raise SolverFailed("CBC's answer misses the budget by more than round-off")
    return picks, status


def _solve_group(ks: Knapsack, members: list[int], need: float, config: PlannerConfig,
                 time_left: float) -> tuple[list[int], str]:
    # Choice 0 of every layer (its lightest and cheapest) is implicit: variables only for the others.
    # Fewer variables, and the budget row's coefficients stay >= 0.
    need -= sum(ks.weight[j][0] for j in members)
    if need <= 0 or not members:
        return [0] * len(members), "optimal"
    import pulp

    costs = [ks.cost[j] for j in members]
    # Costs relative to choice 0, normalised by their largest value, keep CBC's absolute
    # tolerances meaningful whatever the units.
    cost_scale = max((c - row[0] for row in costs for c in row), default=0.0) or 1.0
    prob = pulp.LpProblem("snip_plan", pulp.LpMinimize)
    build = _counted_model if config.aggregate_layers else _binary_model
    layer_vars, terms = build(pulp, prob, ks, members, cost_scale)
    coefs, rhs = _budget_row([[w for w, _ in terms]], need, ks.scale[ks.group[members[0]]])
    keep = [(c, v) for c, (_, v) in zip(coefs, terms) if c > 0]
    prob += pulp.lpDot([c for c, _ in keep], [v for _, v in keep]) >= rhs, "budget"

    try:
        ret = prob.solve(_cbc_command(config, time_left))
    except Exception as exc:  # CBC crashed, could not be started, or wrote no solution
        raise SolverFailed(f"CBC failed: {type(exc).__name__}: {exc}") from exc
    status, has_solution = _status(pulp, prob, ret)
    if not has_solution:
        raise SolverFailed(f"CBC returned no solution (status {status})")
    picks = []
    for j, row in zip(members, layer_vars):
        vals = [v.value() for v in row]
        if any(v is None or not math.isfinite(v) for v in vals):
            raise SolverFailed(f"CBC returned no value for layer {ks.free[j]}")
        picks.append(_read_pick(ks.free[j], vals, cumulative=config.aggregate_layers))
    return picks, status


def _binary_model(pulp, prob, ks: Knapsack, members: list[int], cost_scale: float):
    """One binary per layer and choice i >= 1, at most one per layer (the earlier model).
    Returns the variables per layer and the (budget weight, variable) terms."""
    x = [[prob.add_variable(f"x_{j}_{i}", cat="Binary") for i in range(1, len(ks.choices[j]))]
         for j in members]
    prob += pulp.lpDot([(c - ks.cost[j][0]) / cost_scale for j in members for c in ks.cost[j][1:]],
                       [v for row in x for v in row])
    for j, row in zip(members, x):
        if len(row) > 1:
            prob += pulp.lpSum(row) <= 1, f"one_{j}"
    terms = [(w - ks.weight[j][0], v) for j, row in zip(members, x) for w, v in zip(ks.weight[j][1:], row)]
    return x, terms


def _counted_model(pulp, prob, ks: Knapsack, members: list[int], cost_scale: float):
    """y[j][i-1] in [0, 1]: layer j at choice >= i (non-increasing in i), paying each step's cost
    increment; per class of layers with equal weight rows and per choice i >= 1, an integer count
    N = sum_j y[j][i-1], and the budget on the counts (see the module docstring).
    Returns the variables per layer and the (budget weight, count) terms."""
    y = [[prob.add_variable(f"y_{j}_{i}", lowBound=0, upBound=1) for i in range(1, len(ks.choices[j]))]
         for j in members]
    prob += pulp.lpDot([(row[i] - row[i - 1]) / cost_scale for row in (ks.cost[j] for j in members)
                        for i in range(1, len(row))], [v for r in y for v in r])
    for j, row in zip(members, y):
        for i in range(1, len(row)):
            prob += row[i - 1] - row[i] >= 0, f"step_{j}_{i + 1}"
    classes: dict[tuple, list[int]] = {}
    for pos, j in enumerate(members):
        classes.setdefault(ks.weight[j], []).append(pos)
    terms = []
    for c, (w, layers) in enumerate(classes.items()):
        for i in range(1, len(w)):
            n = prob.add_variable(f"n_{c}_{i}", lowBound=0, upBound=len(layers), cat="Integer")
            prob += pulp.lpSum(y[p][i - 1] for p in layers) - n == 0, f"count_{c}_{i}"
            terms.append((w[i] - w[i - 1], n))
    return y, terms


def _read_pick(key, vals: list[float], *, cumulative: bool) -> int:
    """A layer's choice index from its variables' values (one-hot, or "at choice >= i")."""
    if cumulative:
        if any(min(abs(v), abs(1.0 - v)) > INTEGRAL_TOL for v in vals):
            # Not a vertex (cannot happen for a basic solution); the exact fallback takes over.
            raise SolverFailed(f"CBC returned a fractional choice for layer {key}: {vals}")
        on = [v > 0.5 for v in vals]
        if any(b and not a for a, b in zip(on, on[1:])):
            raise SolverFailed(f"CBC's choice steps for layer {key} are not nested: {vals}")
        return sum(on)
    on = [i + 1 for i, v in enumerate(vals) if v > 0.5]
    if len(on) > 1:
        raise SolverFailed(f"CBC chose {len(on)} precisions for layer {key}")
    return on[0] if on else 0


def _budget_row(weights, need: float, scale: float) -> tuple[list[float], float]:
    """Coefficients (flattened over the rows of `weights`) and right-hand side of one budget row.

    FLOP weights are multiples of a common unit: written as small integers with a rounded-up
    right-hand side, CBC's knapsack cuts and bound rounding apply (several times faster on the 70B
    layout). Otherwise the row is normalised by the group's largest possible weight."""
    flat = [w for row in weights for w in row]
    units = integer_units(flat, need, max_units=1 << 24)  # beyond that, integers buy nothing
    if units is not None:
        ints, rhs = units
        return [float(v) for v in ints], float(rhs)
    return [w / scale for w in flat], need / scale


def _status(pulp, prob, ret) -> tuple[str, bool]:
    """("optimal" | "feasible (...)" | other, has_solution) across PuLP 3 (int) and 4 (stats)."""
    if hasattr(ret, "has_solution"):  # compat: PuLP >= 4 returns LpSolveStats, PuLP 3 a status int
        name = getattr(ret.status, "name", str(ret.status))
        if name in ("Optimal", "GapLimit"):  # GapLimit: proven within gap_rel, which we asked for
            return "optimal", bool(ret.has_solution)
        return (f"feasible ({name})" if ret.has_solution else name), bool(ret.has_solution)
    # PuLP 3: status is the problem status; sol_status says whether the solution is proven optimal.
    sol = getattr(prob, "sol_status", None)
    if ret == pulp.LpStatusOptimal and sol == pulp.LpSolutionOptimal:
        return "optimal", True
    if sol == pulp.LpSolutionIntegerFeasible:
        return "feasible (stopped early)", True
    return pulp.LpStatus.get(ret, str(ret)), False
