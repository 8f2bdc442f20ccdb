import math

import numpy as np
import pytest

from snip_megatron.formats.precision import Precision as P
from snip_megatron.planner.config import PlannerConfig
from snip_megatron.planner.costs import CostTable
from snip_megatron.planner.exact import _integer_units, solve_group
from snip_megatron.planner.flops import flop_table, stage_of_layers, stages_for_keys
from snip_megatron.planner.problem import build_knapsack
from snip_megatron.planner.solve import solve_plan
from snip_megatron.shapes import get_shape


def brute(costs, weights, need):
    combos = np.indices([len(c) for c in costs]).reshape(len(costs), -1)
    cost = sum(np.asarray(c)[i] for c, i in zip(costs, combos))
    weight = sum(np.asarray(w)[i] for w, i in zip(weights, combos))
    return float(cost[weight >= need].min())


def test_real_shapes_fit_the_exact_integer_dp():
    flops = flop_table(get_shape("llama_70b"))
    rng = np.random.default_rng(0)
    costs = CostTable({k: {P.FP8: rng.random(), P.FP4: rng.random()} for k in flops})
    for config in (PlannerConfig(rho=0.75), PlannerConfig(budget="speedup", speedup=3.0,
                                                          allowed=("bf16", "fp8", "fp4"))):
        ks, _ = build_knapsack(costs, flops, config)
        units = _integer_units(ks.weight, ks.need[0], config.exact_max_states)
        assert units is not None and units[1] < 20_000  # qkv:proj:fc1:fc2 = 5:4:28:14 quarter-units
    stages = stages_for_keys(flops, stage_of_layers(80, 8))
    r = solve_plan(costs, flops, PlannerConfig(rho=0.75, solver="exact"), stages=stages)
    assert r.status == "optimal" and r.seconds < 2


def test_float_weights_small_group_is_enumerated_exactly():
    rng = np.random.default_rng(1)
    costs = [tuple(rng.random(3)) for _ in range(9)]
    weights = [tuple(rng.random(3) * math.pi) for _ in range(9)]  # no useful common divisor
    need = 0.6 * sum(max(w) for w in weights)
    picks, status = solve_group(costs, weights, need, max_states=64)
    assert status == "optimal"
    assert sum(w[i] for w, i in zip(weights, picks)) >= need
    assert sum(c[i] for c, i in zip(costs, picks)) == pytest.approx(brute(costs, weights, need))


@pytest.mark.parametrize("states", [16, 256, 1 << 14])
def test_discretised_budget_is_feasible_and_close(states):
    rng = np.random.default_rng(2)
    n = 40  # 2^40 combinations: too many to enumerate
    costs = [(0.0, float(rng.random())) for _ in range(n)]
    weights = [(0.0, float(rng.random() * 1e3 + 1.0) * math.e) for _ in range(n)]
    need = 0.5 * sum(w[1] for w in weights)
    picks, status = solve_group(costs, weights, need, max_states=states)
    assert status == "feasible"
    assert sum(w[i] for w, i in zip(weights, picks)) >= need
    # Against a fine grid: a coarse grid costs at most a little more.
    fine, _ = solve_group(costs, weights, need, max_states=1 << 16)
    got = sum(c[i] for c, i in zip(costs, picks))
    best = sum(c[i] for c, i in zip(costs, fine))
    assert got >= best - 1e-9 if states < 1 << 14 else got == pytest.approx(best, rel=0.05)


def test_met_budget_takes_the_cheapest_choice_everywhere():
    picks, status = solve_group([(0.5, 0.1), (0.2, 0.3)], [(0.0, 1.0), (0.0, 1.0)], 0.0, 64)
    assert picks == [1, 0] and status == "optimal"


def test_fallback_status_reaches_the_result():
    # Float FLOPs and a tiny state cap: the DP is discretised, and the result says "feasible".
    keys = [k for k in flop_table(get_shape("llama_tiny"))]
    rng = np.random.default_rng(3)
    flops = {k: float(rng.random() + 0.1) * math.pi for k in keys}
    costs = {k: {P.FP8: 0.0, P.FP4: float(rng.random())} for k in keys}
    r = solve_plan(costs, flops, PlannerConfig(rho=0.5, solver="exact", exact_max_states=32))
    assert r.solver == "exact" and r.status == "feasible" and r.achieved.fp4_fraction >= 0.5 - 1e-9
