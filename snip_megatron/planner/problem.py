"""The planning problem in one canonical form, shared by the ILP and the exact fallback.

Every budget is written as "weights >= need" per group (a pipeline stage, or the whole model):
- FP4 fraction: weight F_l if layer l is in FP4, else 0; need rho * F_group.
- FP8 fraction: weight F_l if layer l is in FP8 or FP4 (not BF16), else 0; need rho * F_group.
- Time model: weight F_l * (c_max - c_p) (time saved against the slowest precision); need
  F_group * (c_max - c_bf16 / speedup), i.e. sum F_l c_p <= F_group c_bf16 / speedup.
All budgets are linear in F, so per-stage constraints imply the global one and the problem splits
into one multiple-choice knapsack per stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import LayerKey, forward_order, parse_key
from snip_megatron.planner.config import PlannerConfig
from snip_megatron.planner.costs import CostTable
from snip_megatron.planner.flops import validate_flops

# Relative slack on every budget, so float round-off in rho * F never turns a met budget into a miss.
BUDGET_RTOL = 1e-9


@dataclass(frozen=True)
class Achieved:
    """What a plan achieves, by the planner's own models."""

    fp4_fraction: float
    """Fraction of the linear FLOPs that run in FP4."""
    fp8_fraction: float
    """Fraction of the linear FLOPs that run in FP8 or lower (FP8 or FP4, i.e. not BF16): what
    budget="fp8_fraction" counts. Always >= fp4_fraction."""
    speedup: float
    """Modelled linear-GEMM speed-up over all-BF16 (sum F c_bf16 / sum F c_p)."""


def achieved(assignment: Mapping, flops: Mapping, gemm_cost: Mapping) -> Achieved:
    """FP4 and FP8-or-lower FLOP fractions and modelled speed-up of `assignment` (LayerKey ->
    Precision)."""
    total = fp4 = fp8 = time = 0.0
    c_bf16 = gemm_cost[Precision.BF16]
    for key, p in assignment.items():
        f = flops[key]
        total += f
        fp4 += f if p is Precision.FP4 else 0.0
        fp8 += f if p is not Precision.BF16 else 0.0
        time += f * gemm_cost[p]
    if total <= 0:
        return Achieved(fp4_fraction=0.0, fp8_fraction=0.0, speedup=1.0)
    return Achieved(fp4_fraction=fp4 / total, fp8_fraction=fp8 / total, speedup=total * c_bf16 / time)


def achieved_by_stage(assignment: Mapping, flops: Mapping, gemm_cost: Mapping,
                   stages: Mapping) -> dict[int, Achieved]:
    """`achieved` per pipeline stage (stages: LayerKey -> stage)."""
    by_stage: dict[int, dict] = {}
    for key, p in assignment.items():
        by_stage.setdefault(stages[key], {})[key] = p
    return {s: achieved(a, flops, gemm_cost) for s, a in sorted(by_stage.items())}


@dataclass(frozen=True)
class Knapsack:
    """min sum_l cost[l][x_l]  s.t.  sum_{l in g} weight[l][x_l] >= need[g] for every group g."""

    free: tuple
    """LayerKeys the solver chooses for, in forward order."""
    choices: tuple
    """Per free layer, its candidate precisions: only those no other candidate beats on both cost and
    weight, lightest (= cheapest) first."""
    cost: tuple
    """Per free layer and candidate, the cost Q_l(p) plus the switching penalty."""
    weight: tuple
    """Per free layer and candidate, its contribution to its group's budget (>= 0)."""
    group: tuple
    """Per free layer, the index of its group in `need`."""
    need: tuple
    """Per group, the weight the free layers must still supply (after fixed layers; minus a tiny
    round-off slack); <= 0 means the group's budget is already met."""
    scale: tuple
    """Per group, the largest weight the whole group could carry (for normalising)."""
    fixed: dict
    """Layers with one possible precision (pinned, or one allowed choice): LayerKey -> Precision."""
    fixed_cost: float
    """Summed cost of the fixed layers (0 for pinned layers without a cost)."""

    def objective(self, picks) -> float:
        """Total cost of choice indices `picks` (one per free layer), fixed layers included."""
        return self.fixed_cost + sum(c[i] for c, i in zip(self.cost, picks))

    def assignment(self, picks) -> dict[LayerKey, Precision]:
        out = dict(self.fixed)
        out.update((k, ch[i]) for k, ch, i in zip(self.free, self.choices, picks))
        return out

    def feasible(self, picks) -> bool:
        got = [0.0] * len(self.need)
        for w, g, i in zip(self.weight, self.group, picks):
            got[g] += w[i]
        return all(x >= n for x, n in zip(got, self.need))


def _weight(p: Precision, f: float, config: PlannerConfig, gemm: dict, c_max: float) -> float:
    if config.budget == "fp4_fraction":
        return f if p is Precision.FP4 else 0.0
    if config.budget == "fp8_fraction":
        return f if p is not Precision.BF16 else 0.0
    return f * (c_max - gemm[p])


def _describe(config: PlannerConfig, weight_sum: float, group_flops: float, gemm: dict,
              c_max: float) -> float:
    """A group's weight sum in the budget's own units (FP4 or FP8-or-lower fraction, or speed-up)."""
    if config.budget in ("fp4_fraction", "fp8_fraction"):
        return weight_sum / group_flops
    time = group_flops * c_max - weight_sum
    return float("inf") if time <= 0 else group_flops * gemm[Precision.BF16] / time


def _undominated(cands, cost, weight):
    """Drop every choice another one beats (no more cost, no less weight); it can never be needed.
    The rest sorted by weight ascending, hence by cost ascending: choice 0 is the cheapest."""
    keep = []
    for i in range(len(cands)):
        beaten = any((cost[j] <= cost[i] and weight[j] >= weight[i])
                     and (cost[j] < cost[i] or weight[j] > weight[i] or j < i)
                     for j in range(len(cands)) if j != i)
        if not beaten:
            keep.append(i)
    keep.sort(key=lambda i: (weight[i], -cost[i]))
    return [cands[i] for i in keep], [cost[i] for i in keep], [weight[i] for i in keep]


def build_knapsack(costs: CostTable, flops: Mapping, config: PlannerConfig, *,
                   previous: Mapping | None = None, stages: Mapping | None = None,
                   pinned: Mapping | None = None) -> tuple[Knapsack, dict[LayerKey, float]]:
    """The canonical problem and the FLOPs of every planned layer.

    Planned layers are the cost table's keys plus the pinned keys; FLOPs of other layers are ignored.
    Raises ValueError for bad input and for an infeasible budget (naming the largest achievable value).
    """
    pinned = {parse_key(k): Precision.parse(p) for k, p in (pinned or {}).items()}
    previous = {parse_key(k): Precision.parse(p) for k, p in (previous or {}).items()}
    keys = sorted(set(costs) | set(pinned), key=forward_order)
    if not keys:
        raise ValueError("nothing to plan: the cost table is empty and no layer is pinned")
    flops = validate_flops(flops, keys)
    gemm = config.gemm_costs()
    c_max = max(gemm.values())
    allowed = config.allowed_precisions()

    if stages is not None:
        stage_of = {parse_key(k): s for k, s in stages.items()}
        missing = [str(k) for k in keys if k not in stage_of]
        if missing:
            raise ValueError(f"stages has no pipeline stage for layer(s) {', '.join(missing[:5])}")
    if stages is not None and config.per_stage:
        group_ids = sorted({stage_of[k] for k in keys})
    else:
        stage_of = {k: 0 for k in keys}
        group_ids = [0]
    gindex = {s: i for i, s in enumerate(group_ids)}

    group_flops = [0.0] * len(group_ids)
    supplied = [0.0] * len(group_ids)   # weight already carried by fixed layers
    most = [0.0] * len(group_ids)       # largest weight each group can carry
    fixed, fixed_cost = {}, 0.0
    free, choices, cost, weight, group = [], [], [], [], []
    for key in keys:
        g = gindex[stage_of[key]]
        f = flops[key]
        group_flops[g] += f
        row = costs.get(key, {})
        if key in pinned:
            p = pinned[key]
            fixed[key] = p
            fixed_cost += row.get(p, 0.0)
            w = _weight(p, f, config, gemm, c_max)
            supplied[g] += w
            most[g] += w
            continue
        cands = [p for p in allowed if p in row]
        if not cands:
            raise ValueError(f"layer {key} has no cost for any allowed precision "
                             f"({', '.join(p.value for p in allowed)})")
        c = [row[p] + (config.switch_penalty if key in previous and previous[key] is not p else 0.0)
             for p in cands]
        w = [_weight(p, f, config, gemm, c_max) for p in cands]
        most[g] += max(w)
        cands, c, w = _undominated(cands, c, w)
        if len(cands) == 1:
            fixed[key] = cands[0]
            fixed_cost += c[0]
            supplied[g] += w[0]
            continue
        free.append(key)
        choices.append(tuple(cands))
        cost.append(tuple(c))
        weight.append(tuple(w))
        group.append(g)

    need, scale = [], []
    worst = None
    for g, s in enumerate(group_ids):
        f_g = group_flops[g]
        if config.budget in ("fp4_fraction", "fp8_fraction"):
            req, top = config.fraction * f_g, f_g
        else:
            req, top = f_g * (c_max - gemm[Precision.BF16] / config.speedup), f_g * c_max
        slack = BUDGET_RTOL * top
        if most[g] < req - slack:
            best = _describe(config, most[g], f_g, gemm, c_max)
            if worst is None or best < worst[0]:
                worst = (best, s)
        need.append(req - slack - supplied[g])
        scale.append(top)
    if worst is not None:
        what, target = ("speedup", config.speedup) if config.budget == "speedup" else ("rho", config.fraction)
        where = f" (limited by pipeline stage {worst[1]})" if len(group_ids) > 1 else ""
        units = " (the fraction of linear FLOPs in FP8 or lower)" if config.budget == "fp8_fraction" else ""
        raise ValueError(f"infeasible budget: {what}={target}{units} but the largest achievable {what} with "
                         f"allowed={[p.value for p in allowed]} and the pinned layers is "
                         f"{worst[0]:.6g}{where}")
    return Knapsack(free=tuple(free), choices=tuple(choices), cost=tuple(cost), weight=tuple(weight),
                    group=tuple(group), need=tuple(need), scale=tuple(scale), fixed=fixed,
                    fixed_cost=fixed_cost), flops
