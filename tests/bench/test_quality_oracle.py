"""bench/quality_oracle.py: the pinned plans, the knapsack over single-linear harms, SNIP's share."""

import itertools
import math
import random

import pytest

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import all_keys
from snip_megatron.planner.flops import flop_table
from snip_megatron.shapes import ModelShape

SHAPE = ModelShape(name="oracle_test", num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=2,
                   num_query_groups=1, vocab_size=512, seq_length=32)


def test_a_pinned_plan_holds_only_the_named_linears_in_fp4(oracle):
    plan = oracle.pinned_plan(2, ["2.linear_fc1"])
    assert [str(k) for k in plan if plan[k] is Precision.FP4] == ["2.linear_fc1"]
    assert {plan[k] for k in plan if str(k) != "2.linear_fc1"} == {Precision.FP8} and len(plan) == 8
    with pytest.raises(ValueError, match="3.linear_qkv"):
        oracle.pinned_plan(2, ["3.linear_qkv"])


def test_harms_are_taken_to_uniform_fp8(oracle):
    assert oracle.single_harms({"1.linear_qkv": 4.2, "2.linear_fc2": 3.9}, 4.0) == pytest.approx(
        {"1.linear_qkv": 0.2, "2.linear_fc2": -0.1})


@pytest.mark.parametrize("rho", [0.2, 0.5, 0.75, 0.9])
def test_the_oracle_set_is_the_brute_force_optimum(oracle, rho):
    """Against every one of the 256 FP4 sets of a 2-layer model, negative (noise) harms included."""
    rng = random.Random(round(rho * 100))
    keys = all_keys(SHAPE.num_layers)
    harms = {str(k): rng.uniform(-0.002, 0.01) for k in keys}
    flops = flop_table(SHAPE)
    total = sum(flops.values())
    best = min((sum(harms[str(k)] for k in subset), subset)
               for n in range(len(keys) + 1) for subset in itertools.combinations(keys, n)
               if sum(flops[k] for k in subset) >= rho * total * (1 - 1e-9))
    chosen = oracle.oracle_fp4_linears(harms, SHAPE, rho)
    assert sum(harms[k] for k in chosen) == pytest.approx(best[0], abs=1e-12)
    assert sum(flops[k] for k in all_keys(2) if str(k) in chosen) >= rho * total * (1 - 1e-9)
    with pytest.raises(ValueError, match="no single-linear harm for 2.linear_fc2"):
        oracle.oracle_fp4_linears({k: v for k, v in harms.items() if k != "2.linear_fc2"}, SHAPE, rho)


def test_snips_share_pairs_differences_by_seed_before_dividing(oracle):
    recipe = {0: 0.030, 1: 0.050, 2: 0.9}
    snip = {0: 0.020, 1: 0.045}
    orc = {0: 0.010, 1: 0.040, 3: 0.0}
    # seeds 0 and 1 only: mean gains 0.0075 (SNIP) and 0.015 (oracle)
    assert oracle.oracle_share(recipe, snip, orc) == pytest.approx(0.5)
    assert oracle.oracle_share(recipe, {0: 0.035, 1: 0.05}, orc) == pytest.approx(-0.025 / 0.15)
    assert math.isnan(oracle.oracle_share(recipe, snip, {0: 0.04, 1: 0.06}))  # the oracle gains nothing
    assert math.isnan(oracle.oracle_share(recipe, snip, {5: 0.0}))
