"""bench/planner_scale.py's 70B models: the Llama-70B GPT of a TP=8 (with sequence parallelism),
PP=8 layout and the 70B-class HybridModel are enumerated through their adapter's inventory from the
shape or pattern alone (no model built, no weight allocated) and planned with a budget per stage
in under a second (the exact solver here: CBC's time on a shared CPU is the bench's to report)."""

import time

import pytest

from snip_megatron.models import gpt, hybrid
from snip_megatron.planner import PlannerConfig, solve_plan, stage_of_layers
from snip_megatron.shapes import get_shape


def gpt_70b(b):
    shape = get_shape("llama_70b")
    return shape, lambda: gpt.inventory(shape, sequence_parallel=True), stage_of_layers(shape.num_layers, 8), 320


def hybrid_70b(b):
    return (b.HYBRID_70B, lambda: hybrid.inventory(b.HYBRID_70B, b.HYBRID_70B_PATTERN, b.HYBRID_70B_DIMS),
            hybrid.stage_of_layers(b.HYBRID_70B_PATTERN, 8), 2 * b.HYBRID_70B.num_layers)


@pytest.mark.parametrize("model", [gpt_70b, hybrid_70b])
def test_the_70b_models_enumerate_and_plan_in_under_a_second(planner_scale, model):
    b = planner_scale
    shape, enumerate_linears, layer_stage, linears = model(b)
    start = time.perf_counter()
    inv = enumerate_linears()
    flops = inv.flop_table(shape.seq_length)
    enumerated = time.perf_counter() - start
    costs = b.synthetic_costs(inv)
    stages = b.stages_for_keys(costs, layer_stage)
    result = solve_plan(costs, flops, PlannerConfig(rho=0.75, solver="exact"), stages=stages)
    print(f"{shape.name}: {len(inv)} linears enumerated in {enumerated * 1e3:.1f} ms, "
          f"planned over 8 stages in {result.seconds * 1e3:.1f} ms")
    assert len(inv) == linears
    assert enumerated < 0.5 and enumerated + result.seconds < 1.0, (enumerated, result.seconds)
    assert set(result.plan) == set(inv.keys())
    assert min(a.fp4_fraction for a in result.per_stage.values()) >= 0.75 - 1e-6
    assert sorted(set(stages.values())) == list(range(8))
