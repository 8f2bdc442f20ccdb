import math

import numpy as np
import pytest

from snip_megatron.formats.precision import Precision as P
from snip_megatron.planner.baselines import BASELINES, baseline_plan
from snip_megatron.planner.flops import flop_table, stage_of_layers, stages_for_keys
from snip_megatron.shapes import get_shape

SHAPE = get_shape("llama_1b")  # 22 layers
FLOPS = flop_table(SHAPE)
KEYS = list(FLOPS)
REL = {k: float(v) for k, v in zip(KEYS, np.random.default_rng(0).random(len(KEYS)))}
RULES = [b for b in BASELINES if not b.startswith("uniform_")]


def test_names_and_unknown():
    assert BASELINES == ("uniform_bf16", "uniform_fp8", "uniform_fp4", "first_last_k", "last_fraction",
                         "layer_type", "min_rel_error", "random")
    with pytest.raises(ValueError, match="uniform_bf16, uniform_fp8.*random"):
        baseline_plan("heuristic", KEYS, FLOPS, 0.5)


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("rho", [0.0, 0.3, 0.6, 0.75])
@pytest.mark.parametrize("pp", [None, 2])
def test_every_rule_meets_the_budget_globally_and_per_stage(name, rho, pp):
    if rho == 0.75 and name in ("layer_type", "last_fraction"):
        # fc2 is 26% of llama_1b's linear FLOPs; with PP=2 the last 4 layers are 36% of stage 1.
        rho = 0.7 if (name, pp) == ("last_fraction", None) else 0.6
    stages = stages_for_keys(KEYS, stage_of_layers(22, pp)) if pp else None
    r = baseline_plan(name, KEYS, FLOPS, rho, rel_error=REL, stages=stages)
    assert r.solver == name and r.status == "rule" and len(r.plan) == len(KEYS)
    biggest = max(FLOPS.values()) / sum(FLOPS.values())
    assert rho - 1e-9 <= r.achieved.fp4_fraction <= rho + (pp or 1) * biggest + 1e-9  # overshoot < 1 linear
    if pp:
        assert len(r.per_stage) == 2 and all(a.fp4_fraction >= rho - 1e-9 for a in r.per_stage.values())
    assert set(r.plan.values()) <= {P.FP8, P.FP4}


def test_uniform():
    for name, p in (("uniform_bf16", P.BF16), ("uniform_fp8", P.FP8), ("uniform_fp4", P.FP4)):
        r = baseline_plan(name, KEYS, FLOPS, 0.75)
        assert set(r.plan.values()) == {p}
    assert baseline_plan("uniform_fp4", KEYS, FLOPS, 0.9).achieved.fp4_fraction == 1.0
    assert baseline_plan("uniform_fp8", KEYS, FLOPS, 0.9).achieved.speedup == pytest.approx(2.0)


def layers_with(plan, p):
    return {k.layer for k, v in plan.items() if v is p}


def test_first_last_k_keeps_the_edges_high():
    for k in (1, 2):
        plan = baseline_plan("first_last_k", KEYS, FLOPS, 0.75, k=k).plan
        edges = set(range(1, k + 1)) | set(range(23 - k, 23))
        assert not (layers_with(plan, P.FP4) & edges)
    # Budget below what the rule leaves: FP4 grows from the middle layer outwards.
    plan = baseline_plan("first_last_k", KEYS, FLOPS, 0.08).plan  # 1.76 layers' worth
    assert layers_with(plan, P.FP4) == {11, 12}


def test_last_fraction_keeps_the_last_fifteen_percent_high():
    plan = baseline_plan("last_fraction", KEYS, FLOPS, 0.5, high=P.BF16).plan
    assert not (layers_with(plan, P.FP4) & {19, 20, 21, 22})  # ceil(0.15 * 22) = 4
    assert set(plan.values()) == {P.BF16, P.FP4} and plan[(1, "linear_qkv")] is P.FP4
    with pytest.raises(ValueError, match=r"largest rho it can meet is 0\.818"):
        baseline_plan("last_fraction", KEYS, FLOPS, 0.9)


@pytest.mark.parametrize("name", ["first_last_k", "last_fraction", "layer_type"])
def test_relax_meets_any_budget_and_changes_nothing_where_feasible(name):
    small = get_shape("llama_tiny")  # 6 layers: first_last_k and last_fraction top out below 0.9
    flops = flop_table(small)
    keys = list(flops)
    with pytest.raises(ValueError, match="largest rho"):
        baseline_plan(name, keys, flops, 0.9)
    for rho in (0.5, 0.9, 0.95):
        r = baseline_plan(name, keys, flops, rho, relax=True)
        assert r.achieved.fp4_fraction >= rho - 1e-9
    # Where the strict rule is feasible, relaxing it changes nothing.
    assert baseline_plan(name, keys, flops, 0.3, relax=True).plan == baseline_plan(name, keys, flops, 0.3).plan


def test_relaxed_rules_give_their_kept_linears_fp4_last():
    small = get_shape("llama_tiny")
    flops = flop_table(small)
    keys = list(flops)
    edges = baseline_plan("first_last_k", keys, flops, 0.75, relax=True).plan
    assert edges[(1, "linear_qkv")] is P.FP4 or edges[(6, "linear_fc2")] is P.FP4  # one edge layer gave in
    assert all(edges[k] is P.FP4 for k in keys if 2 <= k.layer <= 5)  # every middle layer first
    tail = baseline_plan("last_fraction", keys, flops, 0.9, relax=True).plan
    assert all(tail[k] is P.FP4 for k in keys if k.layer <= 5)
    assert tail[(6, "linear_fc2")] is P.FP8  # the last linear is the last to give in


def test_layer_type_keeps_one_linear_high():
    plan = baseline_plan("layer_type", KEYS, FLOPS, 0.6, keep_type="linear_fc2").plan
    assert all(plan[k] is P.FP8 for k in KEYS if k.name == "linear_fc2")
    with pytest.raises(ValueError, match="keep_type"):
        baseline_plan("layer_type", KEYS, FLOPS, 0.6, keep_type="fc2")


def test_min_rel_error_quantizes_the_least_damaged_first():
    plan = baseline_plan("min_rel_error", KEYS, FLOPS, 0.5, rel_error=REL).plan
    fp4 = [REL[k] for k in KEYS if plan[k] is P.FP4]
    rest = [REL[k] for k in KEYS if plan[k] is not P.FP4]
    assert max(fp4) <= min(rest)
    nested = {k: {"fp8": 0.0, "fp4": v} for k, v in REL.items()}  # per-precision form works too
    assert baseline_plan("min_rel_error", KEYS, FLOPS, 0.5, rel_error=nested).plan == plan
    with pytest.raises(ValueError, match="needs rel_error"):
        baseline_plan("min_rel_error", KEYS, FLOPS, 0.5)
    bad = dict(REL)
    bad[KEYS[5]] = math.nan
    with pytest.raises(ValueError, match=str(KEYS[5]).replace(".", r"\.")):
        baseline_plan("min_rel_error", KEYS, FLOPS, 0.5, rel_error=bad)


def test_random_is_seeded():
    a = baseline_plan("random", KEYS, FLOPS, 0.5, seed=1).plan
    assert a == baseline_plan("random", KEYS, FLOPS, 0.5, seed=1).plan
    assert a != baseline_plan("random", KEYS, FLOPS, 0.5, seed=2).plan


def test_objective_from_costs_and_bad_inputs():
    costs = {k: {"fp8": 0.01, "fp4": 0.1} for k in KEYS}
    r = baseline_plan("uniform_fp4", KEYS, FLOPS, 0.5, costs=costs)
    assert r.objective == pytest.approx(0.1 * len(KEYS))
    assert math.isnan(baseline_plan("uniform_fp4", KEYS, FLOPS, 0.5).objective)
    with pytest.raises(ValueError, match="high=fp4"):
        baseline_plan("random", KEYS, FLOPS, 0.5, high="fp4")
    with pytest.raises(ValueError, match="rho"):
        baseline_plan("random", KEYS, FLOPS, 1.5)


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("budget", ["fp8_fraction", "speedup"])
def test_rules_refuse_a_budget_other_than_the_fp4_fraction(name, budget):
    # rho is an FP4 fraction: an FP8 (or speed-up) run must not get an FP4 plan from it.
    with pytest.raises(ValueError, match=rf"baseline '{name}' is a rule for an FP4 budget.*budget='{budget}'"):
        baseline_plan(name, KEYS, FLOPS, 0.9, rel_error=REL, budget=budget)


def test_uniform_baselines_run_under_any_budget():
    r = baseline_plan("uniform_fp8", KEYS, FLOPS, None, budget="fp8_fraction")  # no FP4 budget to give
    assert set(r.plan.values()) == {P.FP8}
    assert r.achieved.fp8_fraction == 1.0 and r.achieved.fp4_fraction == 0.0
    assert baseline_plan("uniform_bf16", KEYS, FLOPS, 0.9, budget="fp8_fraction").achieved.fp8_fraction == 0.0
    with pytest.raises(ValueError, match="budget='fp8'"):
        baseline_plan("uniform_fp8", KEYS, FLOPS, 0.9, budget="fp8")
    with pytest.raises(ValueError, match="rho=None"):
        baseline_plan("random", KEYS, FLOPS, None)
    # The default is the FP4 budget: the rules run as before.
    assert baseline_plan("random", KEYS, FLOPS, 0.5).achieved.fp4_fraction >= 0.5 - 1e-9
