"""The quality benchmark's oracle: the best plan brute force finds from single-linear FP4 harms.

From a seed's shared-prefix checkpoint, one run per planned linear holds that linear alone in FP4
(every other one in FP8, the high precision every method's plans use) for the whole quantized
phase: its harm is its final validation loss minus the uniform-FP8 run's of the same seed, the
long-horizon truth of that one linear. The oracle plan at FP4 budget rho is the knapsack over those
harms (the same ILP SNIP's planner solves, here with measured harms as the costs), and the oracle
run trains it pinned. If the oracle loses to SNIP, harms do not add up: interactions between
linears matter more than single-linear harms.

Pure functions over the benchmark's results; bench/quality.py runs the runs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import Plan, all_keys, forward_order, parse_key
from snip_megatron.shapes import ModelShape

HIGH = Precision.FP8
"""The precision of every linear a pinned plan does not hold in FP4 (as in the rules' and SNIP's plans)."""


def pinned_plan(num_layers: int, fp4_linears: Iterable[str]) -> Plan:
    """Every planned linear in FP8 except `fp4_linears` ("3.linear_fc1", ...) in FP4."""
    fp4 = {parse_key(k) for k in fp4_linears}
    keys = all_keys(num_layers)
    unknown = fp4 - set(keys)
    if unknown:
        raise ValueError(f"fp4_linears names linears the {num_layers}-layer model lacks: "
                         f"{', '.join(sorted(map(str, unknown)))}")
    return Plan({k: Precision.FP4 if k in fp4 else HIGH for k in keys})


def single_harms(single_loss: Mapping[str, float], fp8_loss: float) -> dict[str, float]:
    """Each linear's FP4 harm: its single-FP4 run's final loss minus the uniform-FP8 run's (same seed)."""
    return {str(parse_key(k)): v - fp8_loss for k, v in single_loss.items()}


def oracle_fp4_linears(harms: Mapping[str, float], shape: ModelShape, rho: float,
                       tokens: int | None = None) -> tuple[str, ...]:
    """The FP4 linears of the plan that meets FP4 budget `rho` at the least summed single-linear harm,
    in forward order. Needs a harm for every planned linear of `shape`."""
    from snip_megatron.planner.config import PlannerConfig
    from snip_megatron.planner.flops import flop_table
    from snip_megatron.planner.solve import solve_plan

    keys = all_keys(shape.num_layers)
    table = {parse_key(k): v for k, v in harms.items()}
    missing = [str(k) for k in keys if k not in table]
    if missing:
        raise ValueError(f"no single-linear harm for {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    costs = {k: {HIGH: 0.0, Precision.FP4: float(table[k])} for k in keys}
    result = solve_plan(costs, flop_table(shape, tokens),
                        PlannerConfig(rho=rho, allowed=(HIGH, Precision.FP4), per_stage=False))
    if result.status != "optimal":
        raise RuntimeError(f"the oracle knapsack at rho={rho} was not solved to optimality ({result.status})")
    return tuple(str(k) for k in sorted(keys, key=forward_order) if result.plan[k] is Precision.FP4)


def oracle_share(recipe: Mapping[int, float], snip: Mapping[int, float], oracle: Mapping[int, float]) -> float:
    """SNIP's share of the oracle's gain over the recipe, (recipe - snip) / (recipe - oracle), from the
    gaps of the seeds all three have, each difference paired by seed and averaged over seeds first
    (a per-seed ratio of two small noisy differences would be unstable). nan without a common seed
    or when the oracle gains nothing over the recipe."""
    seeds = sorted(set(recipe) & set(snip) & set(oracle))
    if not seeds:
        return math.nan
    gain_snip = statistics.fmean(recipe[s] - snip[s] for s in seeds)
    gain_oracle = statistics.fmean(recipe[s] - oracle[s] for s in seeds)
    return gain_snip / gain_oracle if gain_oracle > 0 else math.nan
