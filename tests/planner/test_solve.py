import math
from dataclasses import replace

import numpy as np
import pytest

from snip_megatron.formats.precision import Precision as P
from snip_megatron.plan import LayerKey, Plan, all_keys
from snip_megatron.planner import ilp as ilp_module
from snip_megatron.planner import solve as solve_module
from snip_megatron.planner.config import PlannerConfig
from snip_megatron.planner.flops import flop_table, stage_of_layers, stages_for_keys
from snip_megatron.planner.ilp import cbc_available
from snip_megatron.planner.solve import solve_plan
from snip_megatron.shapes import get_shape

GEMM = {P.BF16: 1.0, P.FP8: 0.5, P.FP4: 0.25}
CBC = cbc_available()


def random_instance(rng, n_keys, precisions):
    keys = all_keys(math.ceil(n_keys / 4))[:n_keys]
    # Integer FLOPs, like real ones (6*n*m*k); a few sizes so budgets bind unevenly.
    flops = {k: float(rng.choice([2, 3, 5, 8, 13]) * 1000) for k in keys}
    costs = {}
    for k in keys:
        fp8 = float(rng.random() * 0.2)
        costs[k] = {P.BF16: 0.0, P.FP8: fp8, P.FP4: fp8 + float(rng.random())}
        costs[k] = {p: c for p, c in costs[k].items() if p in precisions}
    return keys, flops, costs


def brute_force(keys, flops, costs, allowed, stages, budget, target, pinned=None):
    """Independent reference: every combination (vectorised), checked against the budget's definition."""
    pinned = pinned or {}
    options = [[pinned[k]] if k in pinned else list(allowed) for k in keys]
    combos = np.indices([len(o) for o in options]).reshape(len(keys), -1)  # (keys, combinations)
    cost = sum(np.array([costs[k].get(p, 0.0) for p in o])[c] for k, o, c in zip(keys, options, combos))
    stage = stages or {k: 0 for k in keys}
    ok = np.ones(combos.shape[1], dtype=bool)
    for g in set(stage.values()):
        rows = [i for i, k in enumerate(keys) if stage[k] == g]
        total = sum(flops[keys[i]] for i in rows)
        if budget in ("fp4_fraction", "fp8_fraction"):
            counted = (P.FP4,) if budget == "fp4_fraction" else (P.FP8, P.FP4)
            low = sum(np.array([flops[keys[i]] * (p in counted) for p in options[i]])[combos[i]] for i in rows)
            ok &= low >= target * total * (1 - 1e-9)
        else:
            time = sum(np.array([flops[keys[i]] * GEMM[p] for p in options[i]])[combos[i]] for i in rows)
            ok &= total / time >= target * (1 - 1e-9)
    return float(cost[ok].min()) if ok.any() else math.inf


CASES = [  # (seed, linears, precisions, budget, target, per-stage)
    (0, 8, (P.FP8, P.FP4), "fp4_fraction", 0.6, True),
    (1, 12, (P.FP8, P.FP4), "fp4_fraction", 0.75, True),
    (2, 10, (P.BF16, P.FP8, P.FP4), "fp4_fraction", 0.5, True),
    (3, 12, (P.BF16, P.FP8, P.FP4), "fp4_fraction", 0.7, True),
    (4, 9, (P.BF16, P.FP8, P.FP4), "speedup", 2.5, True),
    (5, 12, (P.BF16, P.FP8, P.FP4), "speedup", 3.0, False),
    (6, 11, (P.BF16, P.FP8, P.FP4), "speedup", 2.0, True),
    (7, 12, (P.FP8, P.FP4), "fp4_fraction", 0.35, False),
    (8, 10, (P.BF16, P.FP8), "fp8_fraction", 0.7, True),
    (9, 12, (P.BF16, P.FP8), "fp8_fraction", 0.9, False),
    (10, 11, (P.BF16, P.FP8, P.FP4), "fp8_fraction", 0.6, True),
    (11, 12, (P.BF16, P.FP8, P.FP4), "fp8_fraction", 0.85, False),
]
TARGET_FIELD = {"fp4_fraction": "rho", "fp8_fraction": "rho", "speedup": "speedup"}


@pytest.mark.parametrize("seed,n,allowed,budget,target,per_stage", CASES)
def test_ilp_exact_and_brute_force_agree(seed, n, allowed, budget, target, per_stage):
    rng = np.random.default_rng(seed)
    keys, flops, costs = random_instance(rng, n, allowed)
    stages = {k: (k.layer - 1) % 2 for k in keys} if per_stage else None
    config = PlannerConfig(budget=budget, allowed=allowed, **{TARGET_FIELD[budget]: target})
    truth = brute_force(keys, flops, costs, allowed, stages, budget, target)
    ilp = solve_plan(costs, flops, config, stages=stages)
    exact = solve_plan(costs, flops, replace(config, solver="exact"), stages=stages)
    assert ilp.solver == ("cbc" if CBC else "exact")
    assert exact.solver == "exact" and exact.status == "optimal" and exact.fallback_reason is None
    assert ilp.objective == pytest.approx(truth, rel=1e-6, abs=1e-9)
    assert exact.objective == pytest.approx(truth, rel=1e-9, abs=1e-12)
    for r in (ilp, exact):
        if budget == "fp4_fraction":
            assert r.achieved.fp4_fraction >= target - 1e-9
            assert all(a.fp4_fraction >= target - 1e-9 for a in r.per_stage.values())
        elif budget == "fp8_fraction":
            assert r.achieved.fp8_fraction >= target - 1e-9
            assert all(a.fp8_fraction >= target - 1e-9 for a in r.per_stage.values())
        else:
            assert r.achieved.speedup >= target * (1 - 1e-9)
            assert all(a.speedup >= target * (1 - 1e-9) for a in r.per_stage.values())
        assert set(r.plan.values()) <= set(allowed)
        assert (len(r.per_stage) == 2) == per_stage


def test_per_stage_budget_binds_only_with_stages():
    # Stage 0 is cheap to quantize, stage 1 expensive: a global budget puts all FP4 in stage 0.
    keys = all_keys(4)
    flops = {k: 1.0 for k in keys}
    costs = {k: {P.FP8: 0.0, P.FP4: 0.1 if k.layer <= 2 else 1.0} for k in keys}
    stages = stages_for_keys(keys, stage_of_layers(4, 2))
    config = PlannerConfig(rho=0.5)
    glob = solve_plan(costs, flops, config)
    assert all(glob.plan[k] is (P.FP4 if k.layer <= 2 else P.FP8) for k in keys)
    staged = solve_plan(costs, flops, config, stages=stages)
    assert staged.per_stage[0].fp4_fraction == pytest.approx(0.5)
    assert staged.per_stage[1].fp4_fraction == pytest.approx(0.5)
    off = solve_plan(costs, flops, replace(config, per_stage=False), stages=stages)
    assert off.plan == glob.plan and off.per_stage[1].fp4_fraction == 0.0


def test_70b_layout_meets_global_and_stage_budgets_with_pins():
    shape = get_shape("llama_70b")
    flops = flop_table(shape)
    rng = np.random.default_rng(0)
    costs = {k: {P.FP8: float(rng.random() * 0.1), P.FP4: float(rng.random())} for k in flops}
    stages = stages_for_keys(flops, stage_of_layers(80, 8))
    pinned = {LayerKey(1, "linear_qkv"): P.BF16, LayerKey(80, "linear_fc2"): P.FP8,
              LayerKey(40, "linear_fc1"): P.FP4}
    r = solve_plan(costs, flops, PlannerConfig(rho=0.8), stages=stages, pinned=pinned)
    assert r.status == "optimal" and r.seconds < 60  # generous: CI machines are shared
    assert r.achieved.fp4_fraction >= 0.8 - 1e-9
    assert min(a.fp4_fraction for a in r.per_stage.values()) >= 0.8 - 1e-9
    assert all(r.plan[k] is p for k, p in pinned.items())
    assert len(r.plan) == 320


def test_pinned_layers_stay_pinned_even_against_the_cost():
    keys = all_keys(2)
    flops = {k: 1.0 for k in keys}
    costs = {k: {P.FP8: 0.0, P.FP4: 1.0} for k in keys}
    costs[LayerKey(2, "linear_fc2")] = {P.FP8: 0.0, P.FP4: 100.0}  # most expensive FP4 ...
    pinned = {LayerKey(2, "linear_fc2"): P.FP4, LayerKey(1, "linear_qkv"): "bf16"}  # ... pinned there
    for solver in ("auto", "exact"):
        r = solve_plan(costs, flops, PlannerConfig(rho=0.5, solver=solver), pinned=pinned)
        assert r.plan[LayerKey(2, "linear_fc2")] is P.FP4 and r.plan[LayerKey(1, "linear_qkv")] is P.BF16
        assert r.achieved.fp4_fraction == pytest.approx(0.5)
        assert r.objective == pytest.approx(100.0 + 3.0)


def test_pinned_layer_without_cost_is_planned_and_counted():
    keys = all_keys(1)
    flops = {k: 1.0 for k in keys}
    costs = {k: {P.FP8: 0.0, P.FP4: 1.0} for k in keys[1:]}  # linear_qkv has no cost (NaN stats dropped)
    r = solve_plan(costs, flops, PlannerConfig(rho=0.5), pinned={keys[0]: P.FP8})
    assert r.plan[keys[0]] is P.FP8 and len(r.plan) == 4
    assert r.achieved.fp4_fraction == pytest.approx(0.5)


def _swap_instance():
    """Two equal layers; the previous plan has FP4 on A, the costs now slightly prefer FP4 on B."""
    a, b = LayerKey(1, "linear_fc1"), LayerKey(1, "linear_fc2")
    flops = {a: 1.0, b: 1.0}
    costs = {a: {P.FP8: 0.0, P.FP4: 1.0}, b: {P.FP8: 0.0, P.FP4: 0.9}}  # switching gains 0.1
    previous = Plan({a: P.FP4, b: P.FP8})
    return a, b, flops, costs, previous


@pytest.mark.parametrize("solver", ["auto", "exact"])
def test_switching_penalty_changes_the_answer_only_when_it_should(solver):
    a, b, flops, costs, previous = _swap_instance()
    base = PlannerConfig(rho=0.5, solver=solver)
    free = solve_plan(costs, flops, base, previous=previous)
    assert free.plan[b] is P.FP4 and free.switches == 2 and free.objective == pytest.approx(0.9)
    # A swap costs 2 switches: a penalty below 0.05 each still pays, above it does not.
    small = solve_plan(costs, flops, replace(base, switch_penalty=0.04), previous=previous)
    assert small.plan == free.plan and small.objective == pytest.approx(0.9 + 0.08)
    big = solve_plan(costs, flops, replace(base, switch_penalty=0.06), previous=previous)
    assert big.plan == previous and big.switches == 0 and big.objective == pytest.approx(1.0)
    # No previous plan, or one that is already optimal: the penalty changes nothing.
    assert solve_plan(costs, flops, replace(base, switch_penalty=10.0)).plan == free.plan
    same = solve_plan(costs, flops, replace(base, switch_penalty=10.0), previous=free.plan)
    assert same.plan == free.plan and same.switches == 0
    # The budget still wins over the penalty: a previous plan below budget must change.
    forced = solve_plan(costs, flops, replace(base, rho=1.0, switch_penalty=10.0), previous=previous)
    assert forced.plan[a] is P.FP4 and forced.plan[b] is P.FP4 and forced.switches == 1


def test_cbc_unavailable_falls_back_and_says_so(monkeypatch):
    rng = np.random.default_rng(3)
    keys, flops, costs = random_instance(rng, 8, (P.FP8, P.FP4))
    missing = solve_plan(costs, flops, PlannerConfig(rho=0.5, cbc_path="/nonexistent/cbc"))
    assert missing.solver == "exact" and missing.status == "optimal"
    assert "CBC not found" in missing.fallback_reason
    monkeypatch.setattr(ilp_module, "_cbc_command", lambda config: None)
    simulated = solve_plan(costs, flops, PlannerConfig(rho=0.5))
    assert simulated.solver == "exact" and "CBC not found" in simulated.fallback_reason
    assert simulated.plan == missing.plan
    truth = brute_force(keys, flops, costs, (P.FP8, P.FP4), None, "fp4_fraction", 0.5)
    assert simulated.objective == pytest.approx(truth, rel=1e-12)


def test_cbc_failure_and_early_stop_fall_back(monkeypatch):
    rng = np.random.default_rng(4)
    keys, flops, costs = random_instance(rng, 8, (P.FP8, P.FP4))
    best = solve_plan(costs, flops, PlannerConfig(rho=0.5, solver="exact"))

    def fail(ks, config):
        raise ilp_module.SolverFailed("CBC failed: boom")

    monkeypatch.setattr(solve_module, "solve_ilp", fail)
    r = solve_plan(costs, flops, PlannerConfig(rho=0.5, solver="cbc"))
    assert r.solver == "exact" and r.fallback_reason == "CBC failed: boom" and r.plan == best.plan

    def stopped(ks, config):  # a feasible but poor incumbent, as after a time limit
        return [max(range(len(w)), key=w.__getitem__) for w in ks.weight], "feasible (TimeLimit)"

    def crash(ks, config):  # anything unexpected from PuLP/CBC is a solver failure, not an error
        raise KeyError("pulp internals")

    monkeypatch.setattr(solve_module, "solve_ilp", crash)
    r = solve_plan(costs, flops, PlannerConfig(rho=0.5))
    assert r.solver == "exact" and "KeyError" in r.fallback_reason and r.plan == best.plan

    monkeypatch.setattr(solve_module, "solve_ilp", stopped)
    r = solve_plan(costs, flops, PlannerConfig(rho=0.5))
    assert r.solver == "exact" and "stopped early" in r.fallback_reason
    assert r.objective == pytest.approx(best.objective)


def test_infeasible_budget_names_the_largest_achievable():
    keys = all_keys(2)
    flops = {k: 1.0 for k in keys}
    costs = {k: {P.FP8: 0.0, P.FP4: 1.0} for k in keys}
    pinned = {LayerKey(1, "linear_qkv"): P.FP8}
    with pytest.raises(ValueError, match=r"rho=0.9 .* largest achievable rho .* is 0\.875"):
        solve_plan(costs, flops, PlannerConfig(rho=0.9), pinned=pinned)
    stages = {k: k.layer - 1 for k in keys}  # stage 0 can reach only 3/4
    with pytest.raises(ValueError, match=r"is 0\.75 \(limited by pipeline stage 0\)"):
        solve_plan(costs, flops, PlannerConfig(rho=0.8), pinned=pinned, stages=stages)
    # Time model: FP8 only can reach 2x at most.
    with pytest.raises(ValueError, match=r"speedup=2.5 .* is 2\b"):
        solve_plan(costs, flops, PlannerConfig(budget="speedup", speedup=2.5, allowed=("fp8",)))
    # Just feasible is feasible.
    assert solve_plan(costs, flops, PlannerConfig(rho=0.875), pinned=pinned).achieved.fp4_fraction == 0.875


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "x"])
def test_bad_costs_name_the_layer(bad):
    keys = all_keys(2)
    flops = {k: 1.0 for k in keys}
    costs = {k: {P.FP8: 0.0, P.FP4: 1.0} for k in keys}
    costs[LayerKey(2, "linear_proj")] = {P.FP8: 0.0, P.FP4: bad}
    with pytest.raises(ValueError, match=r"2\.linear_proj"):
        solve_plan(costs, flops, PlannerConfig())


def test_bad_flops_and_missing_costs_are_value_errors():
    keys = all_keys(1)
    costs = {k: {P.FP8: 0.0, P.FP4: 1.0} for k in keys}
    with pytest.raises(ValueError, match=r"1\.linear_fc1 has no FLOP"):
        solve_plan(costs, {k: 1.0 for k in keys if k.name != "linear_fc1"})
    with pytest.raises(ValueError, match=r"FLOPs of layer 1\.linear_qkv"):
        solve_plan(costs, {k: (0.0 if k.name == "linear_qkv" else 1.0) for k in keys})
    costs[keys[2]] = {P.BF16: 0.0}
    with pytest.raises(ValueError, match=r"1\.linear_fc1 has no cost for any allowed"):
        solve_plan(costs, {k: 1.0 for k in keys})
    with pytest.raises(ValueError, match="no pipeline stage"):
        solve_plan({keys[0]: {P.FP8: 0.0, P.FP4: 1.0}}, {keys[0]: 1.0}, stages={})


def test_string_keys_and_names_are_accepted():
    costs = {"1.linear_qkv": {"fp8": 0.0, "fp4": 1.0}, "1.linear_proj": {"fp8": 0.0, "fp4": 0.5}}
    r = solve_plan(costs, {"1.linear_qkv": 1.0, "1.linear_proj": 1.0}, PlannerConfig(rho=0.5),
                   previous={"1.linear_qkv": "FP8", "1.linear_proj": "FP8"}, pinned=None)
    assert r.plan[LayerKey(1, "linear_proj")] is P.FP4 and r.objective == pytest.approx(0.5)
    assert r.switches == 1


@pytest.mark.parametrize("seed", range(12))
def test_random_instances_with_pins_agree_with_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(4, 13))
    allowed = [(P.FP8, P.FP4), (P.BF16, P.FP8, P.FP4), (P.BF16, P.FP4)][seed % 3]
    keys, flops, costs = random_instance(rng, n, allowed)
    pinned = {keys[int(rng.integers(n))]: P.parse(rng.choice(["bf16", "fp8", "fp4"]))}
    stages = {k: int(rng.integers(2)) for k in keys} if seed % 2 else None
    if seed % 4 < 2:
        budget, target, kw = "fp4_fraction", float(rng.uniform(0.1, 0.6)), {}
        kw["rho"] = target
    else:
        budget, target = "speedup", float(rng.uniform(1.5, 2.2))
        kw = {"speedup": target}
    truth = brute_force(keys, flops, costs, allowed, stages, budget, target, pinned)
    config = PlannerConfig(budget=budget, allowed=allowed, **kw)
    if not math.isfinite(truth):
        with pytest.raises(ValueError, match="infeasible budget"):
            solve_plan(costs, flops, config, stages=stages, pinned=pinned)
        return
    for solver in ("auto", "exact"):
        r = solve_plan(costs, flops, replace(config, solver=solver), stages=stages, pinned=pinned)
        assert r.objective == pytest.approx(truth, rel=1e-6, abs=1e-9), solver
        assert all(r.plan[k] is p for k, p in pinned.items())


def test_real_cbc_time_limit_hands_over_to_the_exact_solver():
    # A 126-layer single-budget knapsack that CBC cannot prove in 20 ms; the answer must still be
    # the exact optimum, and the result must say why CBC did not answer.
    shape = get_shape("llama_70b").with_(num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
                                         num_attention_heads=128)
    flops = flop_table(shape)
    rng = np.random.default_rng(0)
    costs = {k: {P.FP8: float(rng.random() * 0.1), P.FP4: float(rng.lognormal(0, 0.7))} for k in flops}
    config = PlannerConfig(rho=0.75, allowed=("bf16", "fp8", "fp4"), time_limit_s=0.02)
    r = solve_plan(costs, flops, config)
    exact = solve_plan(costs, flops, replace(config, solver="exact"))
    assert r.objective == pytest.approx(exact.objective, rel=1e-6)
    if r.solver == "exact":
        assert r.fallback_reason and "CBC" in r.fallback_reason
    else:  # CBC proved it within 20 ms after all
        assert r.solver == "cbc" and r.status == "optimal"


def test_bf16_dominates_fp8_under_an_fp4_fraction_budget():
    # The FP4-fraction budget does not care about BF16 vs FP8, and Q(BF16) = 0 <= Q(FP8).
    keys = all_keys(3)
    flops = {k: float(1 + i % 4) for i, k in enumerate(keys)}
    rng = np.random.default_rng(5)
    costs = {k: {P.FP8: float(rng.random() * 0.1), P.FP4: float(rng.random())} for k in keys}
    for solver in ("auto", "exact"):
        r = solve_plan(costs, flops, PlannerConfig(rho=0.5, allowed=("bf16", "fp8", "fp4"), solver=solver))
        assert set(r.plan.values()) == {P.BF16, P.FP4}
    # Under the time model FP8 earns its place.
    r = solve_plan(costs, flops, PlannerConfig(budget="speedup", speedup=2.2, allowed=("bf16", "fp8", "fp4")))
    assert P.FP8 in set(r.plan.values()) and r.achieved.speedup >= 2.2 * (1 - 1e-9)
