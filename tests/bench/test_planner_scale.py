"""bench/planner_scale.py: its 70B-class HybridModel is enumerated from its pattern and planned in
under a second (the exact solver here: CBC's time on a shared CPU is the bench's to report)."""

import time

from snip_megatron.models import hybrid
from snip_megatron.planner import PlannerConfig, solve_plan


def test_the_70b_class_hybrid_enumerates_and_plans_in_under_a_second(planner_scale):
    b = planner_scale
    start = time.perf_counter()
    inv = hybrid.inventory(b.HYBRID_70B, b.HYBRID_70B_PATTERN, b.HYBRID_70B_DIMS)
    flops = inv.flop_table(b.HYBRID_70B.seq_length)
    enumerated = time.perf_counter() - start
    costs = b.synthetic_costs(inv)
    stages = b.stages_for_keys(costs, hybrid.stage_of_layers(b.HYBRID_70B_PATTERN, 8))
    result = solve_plan(costs, flops, PlannerConfig(rho=0.75, solver="exact"), stages=stages)
    assert len(inv) == 2 * b.HYBRID_70B.num_layers == 224
    assert enumerated < 0.5 and enumerated + result.seconds < 1.0, (enumerated, result.seconds)
    assert set(result.plan) == set(inv.keys())
    assert min(a.fp4_fraction for a in result.per_stage.values()) >= 0.75 - 1e-6
    assert sorted(set(stages.values())) == list(range(8))
