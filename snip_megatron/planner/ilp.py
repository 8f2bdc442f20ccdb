"""The multiple-choice knapsack as an ILP, solved by CBC through PuLP (3.x and 4.x)."""

from __future__ import annotations

import math
import os

from snip_megatron.planner.config import PlannerConfig
from snip_megatron.planner.problem import Knapsack


class SolverUnavailable(RuntimeError):
    """CBC (or PuLP) cannot be used here; the caller falls back to the exact solver."""


class SolverFailed(RuntimeError):
    """CBC ran but returned no usable answer."""


def _cbc_command(config: PlannerConfig):
    """A PuLP COIN_CMD for the CBC binary to use, or None when there is none.

    PuLP < 4 bundles CBC (we point COIN_CMD at that binary rather than using the deprecated
    PULP_CBC_CMD); PuLP >= 4 finds it through the `cbcbox` wheel (`pulp[cbc]`) or PATH."""
    try:
        import pulp
    except Exception:
        return None
    path = config.cbc_path
    if path is None:
        bundled = getattr(getattr(pulp, "PULP_CBC_CMD", None), "pulp_cbc_path", None)
        if bundled and os.path.isfile(bundled):
            path = bundled
    kwargs = dict(msg=False, timeLimit=config.time_limit_s, gapRel=config.gap_rel)
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


def solve_ilp(ks: Knapsack, config: PlannerConfig) -> tuple[list[int], str]:
    """Choice indices (one per free layer) and status "optimal" or "feasible" (stopped early with an
    incumbent). Raises SolverUnavailable or SolverFailed; never anything else for a valid Knapsack."""
    if not ks.free:
        return [], "optimal"
    cmd = _cbc_command(config)
    if cmd is None:
        raise SolverUnavailable("CBC not found (PuLP >= 4 needs `pip install pulp[cbc]`, or set "
                                "PlannerConfig.cbc_path)")
    import pulp

    # Normalised coefficients (costs by their largest magnitude, weights by the group's largest
    # possible weight) keep CBC's absolute tolerances meaningful whatever the units.
    cost_scale = max((abs(c) for row in ks.cost for c in row), default=0.0) or 1.0
    prob = pulp.LpProblem("snip_plan", pulp.LpMinimize)
    x = [[prob.add_variable(f"x_{j}_{i}", cat="Binary") for i in range(len(row))]
         for j, row in enumerate(ks.choices)]
    prob += pulp.lpDot([c / cost_scale for row in ks.cost for c in row], [v for row in x for v in row])
    for j, row in enumerate(x):
        prob += pulp.lpSum(row) == 1, f"one_{j}"
    for g, need in enumerate(ks.need):
        if need <= 0:
            continue
        coefs, terms = [], []
        for j, gj in enumerate(ks.group):
            if gj != g:
                continue
            for i, w in enumerate(ks.weight[j]):
                if w > 0:
                    coefs.append(w / ks.scale[g])
                    terms.append(x[j][i])
        prob += pulp.lpDot(coefs, terms) >= need / ks.scale[g], f"budget_{g}"
    try:
        ret = prob.solve(cmd)
    except Exception as exc:  # CBC crashed, could not be started, or wrote no solution
        raise SolverFailed(f"CBC failed: {type(exc).__name__}: {exc}") from exc
    status, has_solution = _status(pulp, prob, ret)
    if not has_solution:
        raise SolverFailed(f"CBC returned no solution (status {status})")
    picks = []
    for j, row in enumerate(x):
        vals = [v.value() for v in row]
        if any(v is None or not math.isfinite(v) for v in vals):
            raise SolverFailed(f"CBC returned no value for layer {ks.free[j]}")
        on = [i for i, v in enumerate(vals) if v > 0.5]
        if len(on) != 1:
            raise SolverFailed(f"CBC chose {len(on)} precisions for layer {ks.free[j]}")
        picks.append(on[0])
    if not ks.feasible(picks):  # integral but outside CBC's tolerance of the budget
        raise SolverFailed("CBC's answer misses the budget by more than round-off")
    return picks, status


def _status(pulp, prob, ret) -> tuple[str, bool]:
    """("optimal" | "feasible" | other, has_solution) across PuLP 3 (int status) and 4 (stats)."""
    if hasattr(ret, "has_solution"):  # PuLP >= 4: LpSolveStats
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

