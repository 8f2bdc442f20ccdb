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


def test_deepseek_v3_is_enumerated_at_its_layout_and_planned_per_stage(planner_scale):
    """DeepSeek-V3 (61 layers of MLA, 58 MoE with 256 routed experts and a shared one, an MoE MTP
    layer) enumerated from its widths, its units' stages from Megatron's custom layout at PP=16 x
    VPP=2 (the MTP layer on the last stage), planned with a budget per stage; the bench times it."""
    from snip_megatron.models.published import DEEPSEEK_V3

    b = planner_scale
    inv = DEEPSEEK_V3.inventory(sequence_parallel=True)
    stages = b.deepseek_v3_stages()
    names = {k.name for k in inv.keys()}
    assert len(inv) == 553 and {"expert_fc1", "shared_expert_fc2", "linear_q_down_proj", "mtp.expert_fc1"} <= names
    assert set(stages) == set(inv.keys()) and sorted(set(stages.values())) == list(range(16))
    assert {s for k, s in stages.items() if k.name.startswith("mtp.")} == {15}
    # the layout's chunk 16 (stage 0's second) holds layers 32 and 33
    assert stages[gpt.LayerKey(32, "expert_fc1")] == stages[gpt.LayerKey(33, "linear_proj")] == 0
    costs = b.synthetic_costs(inv)
    result = solve_plan(costs, inv.flop_table(DEEPSEEK_V3.shape.seq_length), PlannerConfig(rho=0.75), stages=stages)
    print(f"deepseek_v3: {len(inv)} units planned over 16 stages in {result.seconds * 1e3:.1f} ms ({result.solver})")
    assert set(result.plan) == set(inv.keys())
    assert min(a.fp4_fraction for a in result.per_stage.values()) >= 0.75 - 1e-6
