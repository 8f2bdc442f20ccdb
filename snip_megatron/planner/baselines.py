"""Heuristic baselines behind the same result type and FP4-budget semantics as solve_plan.

Every rule except the uniform ones is "a priority order over the eligible linears": FP4 is given in
that order, per group (each pipeline stage when `stages` is given, else the whole model), until the
group's FP4 FLOPs reach rho of its linear FLOPs (so it may overshoot by at most one linear); every
other linear runs in `high`. Linears a rule keeps high by definition are never eligible; if the
eligible ones cannot reach rho, ValueError names the largest rho the rule can meet, unless `relax`
is set: then the kept linears get FP4 last (in the rule's own order), so a rule meets any budget and
is unchanged wherever it was feasible. So methods are compared at equal FP4 budgets, as in the
paper's table.

The rules are FP4-budget rules only: `budget` (the run's PlannerConfig.budget) other than
"fp4_fraction" is refused for them, so an FP8 or speed-up budget is never read as an FP4 fraction.
The uniform baselines ignore the budget and run under any.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Mapping

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import LayerKey, Plan, forward_order, parse_key
from snip_megatron.planner.config import BUDGETS, DEFAULT_GEMM_COST
from snip_megatron.planner.costs import CostTable
from snip_megatron.planner.flops import validate_flops
from snip_megatron.planner.problem import BUDGET_RTOL, achieved, achieved_by_stage
from snip_megatron.planner.solve import PlanResult

BASELINES = ("uniform_bf16", "uniform_fp8", "uniform_fp4", "first_last_k", "last_fraction",
             "layer_type", "min_rel_error", "random")


def baseline_plan(name: str, keys: Iterable, flops: Mapping, rho: float | None, *,
                  high: Precision | str = Precision.FP8, rel_error: Mapping | None = None,
                  seed: int = 0, k: int = 1, fraction: float = 0.15, keep_type: "str | None" = None,
                  stages: Mapping | None = None, costs: Mapping | None = None,
                  gemm_cost: Mapping | None = None, relax: bool = False,
                  budget: str = "fp4_fraction") -> PlanResult:
    """The plan of baseline `name` at FP4 budget `rho`.

    - uniform_bf16 / uniform_fp8 / uniform_fp4: every linear in that precision (rho is ignored and
      may be None).
    - first_last_k: the linears of the first k and last k transformer layers stay high (Megatron's
      --first-last-layers-bf16); FP4 goes to the others from the middle layer outwards.
    - last_fraction: the last ceil(fraction * layers) transformer layers stay high (NVIDIA's NVFP4
      recipe keeps the last ~15%); FP4 goes to the others in forward order.
    - layer_type: every `keep_type` linear stays high (default: the kind of linear that comes last in
      forward order, a dense GPT's MLP down-projection); FP4 goes to the others in forward order.
    - min_rel_error: FP4 goes first to the linears whose relative FP4 quantization error (`rel_error`:
      LayerKey -> float, or LayerKey -> {Precision: float}) is smallest.
    - random: FP4 in a random order drawn from `seed`.
    `relax`: where the linears a rule keeps high leave less than rho, they get FP4 last (first_last_k:
    the outermost layers last; last_fraction: in forward order; layer_type: `keep_type` last) instead
    of the budget being refused.
    `costs` (optional, a cost table) only fills the result's objective; `gemm_cost` the speed-up model.
    `budget`: the budget kind of the run; every rule but the uniform ones needs "fp4_fraction"
    (ValueError otherwise: `rho` is an FP4 fraction, never an FP8 one).
    """
    start = time.perf_counter()
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; valid: {', '.join(BASELINES)}")
    if budget not in BUDGETS:
        raise ValueError(f"budget={budget!r} is unknown; valid: {', '.join(BUDGETS)}")
    if budget != "fp4_fraction" and not name.startswith("uniform_"):
        raise ValueError(f"baseline {name!r} is a rule for an FP4 budget (FP4 in its order until rho of "
                         f"the linear FLOPs); budget={budget!r} has no such rule: use budget='fp4_fraction', "
                         "or a uniform baseline (uniform_bf16, uniform_fp8), or the planner")
    keys = sorted({parse_key(key) for key in keys}, key=forward_order)
    if not keys:
        raise ValueError("baseline_plan needs at least one layer key")
    flop_of = validate_flops(flops, keys)
    high = Precision.parse(high)
    if high is Precision.FP4:
        raise ValueError("high=fp4: the precision of the non-FP4 linears must be bf16 or fp8")
    if not name.startswith("uniform_") and (not isinstance(rho, (int, float)) or not 0.0 <= rho <= 1.0):
        raise ValueError(f"rho={rho!r} must be a fraction in [0, 1]")
    stage_of = None
    if stages is not None:
        stage_of = {parse_key(key): s for key, s in stages.items()}
        missing = [str(key) for key in keys if key not in stage_of]
        if missing:
            raise ValueError(f"stages has no pipeline stage for layer(s) {', '.join(missing[:5])}")

    if name.startswith("uniform_"):
        p = Precision.parse(name.removeprefix("uniform_"))
        assignment = {key: p for key in keys}
    else:
        order, kept = _priority(name, keys, rel_error=rel_error, seed=seed, k=k, fraction=fraction,
                                keep_type=keep_type)
        if not relax:
            order = [key for key in order if key not in kept]
        assignment = _fill(name, keys, order, flop_of, rho, high, stage_of)

    gemm = {Precision.parse(p): float(c) for p, c in (gemm_cost or DEFAULT_GEMM_COST).items()}
    return PlanResult(
        plan=Plan(assignment),
        solver=name,
        status="rule",
        objective=_objective(assignment, costs),
        achieved=achieved(assignment, flop_of, gemm),
        per_stage=achieved_by_stage(assignment, flop_of, gemm, stage_of) if stage_of else {},
        seconds=time.perf_counter() - start,
    )


def _priority(name: str, keys: list[LayerKey], *, rel_error, seed, k, fraction,
              keep_type) -> tuple[list[LayerKey], set[LayerKey]]:
    """Rule `name`'s order over every linear (the first to get FP4 first, the linears it keeps high
    last) and the set it keeps high."""
    layers = sorted({key.layer for key in keys})
    pos = {layer: i for i, layer in enumerate(layers)}
    n = len(layers)
    if name == "first_last_k":
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"k={k!r} must be a non-negative integer")
        centre = (n - 1) / 2  # middle-out: the k outermost layers at each end come last
        order = sorted(keys, key=lambda key: (abs(pos[key.layer] - centre), forward_order(key)))
        return order, {key for key in keys if not k <= pos[key.layer] < n - k}
    if name == "last_fraction":
        if not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction={fraction!r} must be in [0, 1]")
        kept = math.ceil(fraction * n - 1e-9)
        return list(keys), {key for key in keys if pos[key.layer] >= n - kept}
    if name == "layer_type":
        names = list(dict.fromkeys(key.name for key in keys))
        keep_type = names[-1] if keep_type is None else keep_type  # keys are in forward order
        if keep_type not in names:
            raise ValueError(f"keep_type={keep_type!r} is unknown; valid: {', '.join(names)}")
        order = sorted(keys, key=lambda key: (key.name == keep_type, forward_order(key)))
        return order, {key for key in keys if key.name == keep_type}
    if name == "min_rel_error":
        err = _fp4_errors(rel_error, keys)
        return sorted(keys, key=lambda key: (err[key], forward_order(key))), set()
    # random
    order = list(keys)
    random.Random(seed).shuffle(order)
    return order, set()


def _fp4_errors(rel_error: Mapping | None, keys: list[LayerKey]) -> dict[LayerKey, float]:
    if rel_error is None:
        raise ValueError("baseline 'min_rel_error' needs rel_error (LayerKey -> relative FP4 error)")
    table = {parse_key(key): v for key, v in rel_error.items()}
    out = {}
    for key in keys:
        if key not in table:
            raise ValueError(f"rel_error has no value for layer {key}")
        v = table[key]
        if isinstance(v, Mapping):
            v = {Precision.parse(p): e for p, e in v.items()}.get(Precision.FP4)
            if v is None:
                raise ValueError(f"rel_error of layer {key} has no fp4 entry")
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"rel_error of layer {key} is not a number: {v!r}") from None
        if not math.isfinite(v):
            raise ValueError(f"rel_error of layer {key} is {v} (NaN/Inf)")
        out[key] = v
    return out


def _fill(name, keys, order, flop_of, rho, high, stage_of) -> dict[LayerKey, Precision]:
    """FP4 in `order`, per group, until each group's FP4 FLOPs reach rho of its FLOPs."""
    group_of = stage_of or {key: 0 for key in keys}
    total: dict = {}
    reachable: dict = {}
    for key in keys:
        total[group_of[key]] = total.get(group_of[key], 0.0) + flop_of[key]
    for key in order:
        reachable[group_of[key]] = reachable.get(group_of[key], 0.0) + flop_of[key]
    worst = min(total, key=lambda g: reachable.get(g, 0.0) / total[g])
    best_rho = reachable.get(worst, 0.0) / total[worst]
    if best_rho < rho - BUDGET_RTOL:
        where = f" (limited by pipeline stage {worst})" if stage_of else ""
        raise ValueError(f"infeasible budget: baseline {name!r} keeps too many linears high to reach "
                         f"rho={rho}; the largest rho it can meet is {best_rho:.6g}{where}")
    assignment = {key: high for key in keys}
    got = {g: 0.0 for g in total}
    for key in order:
        g = group_of[key]
        if got[g] >= (rho - BUDGET_RTOL) * total[g]:
            continue
        assignment[key] = Precision.FP4
        got[g] += flop_of[key]
    return assignment


def _objective(assignment, costs) -> float:
    if costs is None:
        return math.nan
    table = CostTable.of(costs)
    return sum(table[key].get(p, math.nan) if key in table else math.nan
               for key, p in assignment.items())
