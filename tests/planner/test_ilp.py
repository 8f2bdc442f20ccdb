"""The CBC model with one integer count per class of equal-weight layers, against the exact DP."""

import math
from dataclasses import replace

import numpy as np
import pytest

from snip_megatron.formats.precision import Precision as P
from snip_megatron.plan import LayerKey, all_keys
from snip_megatron.planner.config import PlannerConfig
from snip_megatron.planner.flops import flop_table, stage_of_layers, stages_for_keys
from snip_megatron.planner.ilp import cbc_available
from snip_megatron.planner.solve import solve_plan
from snip_megatron.shapes import ModelShape

pytestmark = [pytest.mark.compat, pytest.mark.skipif(not cbc_available(), reason="CBC is not installed here")]

TWO = (P.FP8, P.FP4)
THREE = (P.BF16, P.FP8, P.FP4)
# FLOPs per linear, as in a real layer (qkv:proj:fc1:fc2 = 5:4:28:14), so every layer repeats the
# same four weights and the classes are as large as the model is deep.
LINEAR_FLOPS = {"linear_qkv": 5_000.0, "linear_proj": 4_000.0, "linear_fc1": 28_000.0,
                "linear_fc2": 14_000.0}


def layered_instance(rng, layers, allowed):
    keys = all_keys(layers)
    flops = {k: LINEAR_FLOPS[k.name] for k in keys}
    costs = {}
    for k in keys:
        fp4 = float(rng.lognormal(0.0, 0.7))
        # FP8 from 2% to 95% of FP4: near the top, the step BF16 -> FP8 costs more per unit of time
        # saved than FP8 -> FP4, and a model without its "at FP4 implies at FP8 or above" rows
        # would take the second step alone.
        row = {P.BF16: 0.0, P.FP8: fp4 * float(rng.uniform(0.02, 0.95)), P.FP4: fp4}
        costs[k] = {p: c for p, c in row.items() if p in allowed}
    return keys, flops, costs


CASES = [  # (seed, layers, allowed, budget, target, pipeline stages, switch penalty, pins)
    (0, 3, TWO, "fp4_fraction", 0.6, 1, 0.0, 0),
    (1, 4, THREE, "fp4_fraction", 0.75, 1, 0.0, 0),
    (2, 4, THREE, "speedup", 2.5, 2, 0.0, 1),
    (3, 6, (P.BF16, P.FP4), "fp4_fraction", 0.5, 2, 0.1, 0),
    (4, 16, TWO, "fp4_fraction", 0.9, 1, 0.0, 2),
    (5, 16, THREE, "fp4_fraction", 0.8, 4, 0.05, 0),
    (6, 24, THREE, "speedup", 3.0, 1, 0.0, 0),
    (7, 24, THREE, "speedup", 2.0, 3, 0.02, 3),
    (8, 32, TWO, "fp4_fraction", 0.75, 1, 0.1, 0),
    (9, 40, THREE, "speedup", 3.3, 1, 0.0, 2),
    (10, 8, (P.BF16, P.FP8), "fp8_fraction", 0.8, 2, 0.0, 1),
    (11, 16, THREE, "fp8_fraction", 0.9, 1, 0.05, 2),
    (12, 24, (P.BF16, P.FP8), "fp8_fraction", 0.7, 3, 0.02, 0),
    (13, 40, (P.BF16, P.FP8), "fp8_fraction", 0.95, 1, 0.0, 3),
]
TARGET_FIELD = {"fp4_fraction": "rho", "fp8_fraction": "rho", "speedup": "speedup"}


@pytest.mark.parametrize("seed,layers,allowed,budget,target,pp,penalty,pins", CASES)
def test_counted_model_matches_the_exact_dp(seed, layers, allowed, budget, target, pp, penalty, pins):
    rng = np.random.default_rng(seed)
    keys, flops, costs = layered_instance(rng, layers, allowed)
    stages = {k: (k.layer - 1) * pp // layers for k in keys} if pp > 1 else None
    previous = {k: allowed[int(rng.integers(len(allowed)))] for k in keys} if penalty else None
    pinned = {keys[int(i)]: P.FP8 for i in rng.choice(len(keys), size=pins, replace=False)}
    config = PlannerConfig(budget=budget, allowed=allowed, switch_penalty=penalty, **{TARGET_FIELD[budget]: target})
    args = dict(previous=previous, stages=stages, pinned=pinned)

    counted = solve_plan(costs, flops, config, **args)
    exact = solve_plan(costs, flops, replace(config, solver="exact"), **args)
    plain = solve_plan(costs, flops, replace(config, aggregate_layers=False), **args)
    assert exact.status == "optimal"
    assert counted.solver == "cbc" and counted.status == "optimal" and counted.fallback_reason is None
    assert counted.objective == pytest.approx(exact.objective, rel=1e-9, abs=1e-12)
    # Lognormal costs: no two plans cost the same, so the optimum is unique.
    assert counted.plan == exact.plan
    assert plain.solver == "cbc" and plain.objective == pytest.approx(exact.objective, rel=1e-6)
    assert all(counted.plan[k] is p for k, p in pinned.items())
    for r in [counted.achieved, *counted.per_stage.values()]:
        if budget == "fp4_fraction":
            assert r.fp4_fraction >= target - 1e-9
        elif budget == "fp8_fraction":
            assert r.fp8_fraction >= target - 1e-9
        else:
            assert r.speedup >= target * (1 - 1e-9)


def test_float_flops_without_repeated_weights_still_match():
    # Every layer its own class: the counts are the binaries of the plain model. Nine linears, so
    # the exact fallback enumerates them (float weights have no small common unit).
    rng = np.random.default_rng(11)
    keys = all_keys(3)[:9]
    flops = {k: float(rng.random() + 0.1) * math.pi for k in keys}
    costs = {k: {P.BF16: 0.0, P.FP8: float(rng.random()) * 0.1, P.FP4: float(rng.random())} for k in keys}
    config = PlannerConfig(budget="speedup", speedup=2.2, allowed=THREE)
    counted = solve_plan(costs, flops, config)
    exact = solve_plan(costs, flops, replace(config, solver="exact"))
    assert counted.solver == "cbc" and counted.status == "optimal"
    assert exact.status == "optimal"
    assert counted.objective == pytest.approx(exact.objective, rel=1e-9)
    assert counted.plan == exact.plan


# The largest layout of bench/planner_scale.py: 126 layers, 16384 hidden, 53248 FFN.
LLAMA_405B = ModelShape(name="llama_405b", num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
                        num_attention_heads=128, num_query_groups=8, vocab_size=128256, seq_length=8192)


def shaped_costs(shape, seed):
    """FP4 lognormal, edge layers up to 4x, FP8 2-10% of FP4, BF16 free (as the benchmark)."""
    rng = np.random.default_rng(seed)
    costs = {}
    for key in flop_table(shape, tokens=1):
        edge = min(key.layer - 1, shape.num_layers - key.layer)
        fp4 = float(rng.lognormal(0.0, 0.7) * (1.0 + 3.0 * math.exp(-edge / 2.0)))
        costs[key] = {P.BF16: 0.0, P.FP8: fp4 * float(rng.uniform(0.02, 0.1)), P.FP4: fp4}
    return costs


# CBC time limits: the benchmark's 2 s target for one model, more for nine stages' CBC processes on a
# shared machine. The plain model needs 4-10 s on the first two cases; the counted one 0.05-0.3 s.
@pytest.mark.parametrize("config,pp,limit", [
    (PlannerConfig(rho=0.75, allowed=THREE), None, 2.0),
    (PlannerConfig(rho=0.9, allowed=THREE), None, 2.0),
    (PlannerConfig(budget="speedup", speedup=3.0, allowed=THREE), None, 2.0),
    (PlannerConfig(budget="speedup", speedup=3.0, allowed=THREE), 9, 5.0),
])
def test_largest_benchmark_layout_is_proven_optimal(config, pp, limit):
    flops = flop_table(LLAMA_405B)
    costs = shaped_costs(LLAMA_405B, seed=0)
    stages = stages_for_keys(costs, stage_of_layers(126, pp)) if pp else None
    config = replace(config, time_limit_s=limit)
    r = solve_plan(costs, flops, config, stages=stages)
    exact = solve_plan(costs, flops, replace(config, solver="exact"), stages=stages)
    assert r.solver == "cbc" and r.status == "optimal" and r.fallback_reason is None
    assert exact.status == "optimal"
    assert r.objective == pytest.approx(exact.objective, rel=1e-9)
    assert r.plan == exact.plan


def test_fractional_cbc_answer_falls_back_to_the_exact_solver(monkeypatch):
    # A double for a CBC that returns a non-vertex: every choice variable at 0.5.
    import pulp

    rng = np.random.default_rng(5)
    keys, flops, costs = layered_instance(rng, 4, TWO)
    monkeypatch.setattr(pulp.LpVariable, "value", lambda self: 0.5)
    r = solve_plan(costs, flops, PlannerConfig(rho=0.5))
    assert r.solver == "exact" and r.status == "optimal"
    assert "fractional" in r.fallback_reason
    assert r.achieved.fp4_fraction >= 0.5 - 1e-9
    assert LayerKey(1, "linear_qkv") in r.plan
