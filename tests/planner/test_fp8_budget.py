"""budget="fp8_fraction": at least rho of the linear FLOPs in FP8 or lower (Hopper's BF16-or-FP8 plan)."""

import math
from dataclasses import replace

import numpy as np
import pytest

from snip_megatron.formats.precision import Precision as P
from snip_megatron.plan import LayerKey, all_keys
from snip_megatron.planner.config import PlannerConfig
from snip_megatron.planner.costs import CostTable
from snip_megatron.planner.exact import _integer_units
from snip_megatron.planner.flops import flop_table, stage_of_layers, stages_for_keys
from snip_megatron.planner.problem import achieved, achieved_by_stage, build_knapsack
from snip_megatron.planner.solve import solve_plan
from snip_megatron.shapes import get_shape

HOPPER = (P.BF16, P.FP8)
THREE = (P.BF16, P.FP8, P.FP4)
GEMM = {P.BF16: 1.0, P.FP8: 0.5, P.FP4: 0.25}
SOLVERS = ("auto", "exact")


def fp8_config(rho, allowed=HOPPER, **kw):
    return PlannerConfig(budget="fp8_fraction", rho=rho, allowed=allowed, **kw)


def test_achieved_counts_fp8_and_fp4_as_fp8_or_lower():
    a, b, c, d = all_keys(1)
    flops = {a: 1.0, b: 2.0, c: 3.0, d: 4.0}
    met = achieved({a: P.BF16, b: P.FP8, c: P.FP4, d: P.FP8}, flops, GEMM)
    assert met.fp4_fraction == pytest.approx(0.3)
    assert met.fp8_fraction == pytest.approx(0.9)
    assert met.speedup == pytest.approx(10.0 / (1.0 + 1.0 + 0.75 + 2.0))
    assert achieved({}, flops, GEMM).fp8_fraction == 0.0
    assert achieved({a: P.BF16}, flops, GEMM).fp8_fraction == 0.0
    by = achieved_by_stage({a: P.BF16, b: P.FP8, c: P.FP4, d: P.BF16}, flops, GEMM, {a: 0, b: 0, c: 1, d: 1})
    assert by[0].fp8_fraction == pytest.approx(2 / 3) and by[1].fp8_fraction == pytest.approx(3 / 7)


def test_knapsack_weights_fp8_and_fp4_alike():
    # Under fp8_fraction FP8 and FP4 weigh the same, so the dearer of the two is dominated.
    keys = all_keys(1)
    flops = {k: float(i + 1) for i, k in enumerate(keys)}
    costs = {keys[0]: {P.BF16: 0.0, P.FP8: 0.1, P.FP4: 0.5},   # FP4 dearer: BF16 or FP8
             keys[1]: {P.BF16: 0.0, P.FP8: 0.5, P.FP4: 0.2},   # FP8 dearer: BF16 or FP4
             keys[2]: {P.BF16: 0.0, P.FP8: 0.3},
             keys[3]: {P.BF16: 0.0, P.FP8: 0.3}}
    ks, _ = build_knapsack(CostTable.of(costs), flops, fp8_config(0.5, THREE))
    assert ks.choices == ((P.BF16, P.FP8), (P.BF16, P.FP4), (P.BF16, P.FP8), (P.BF16, P.FP8))
    assert ks.weight == ((0.0, 1.0), (0.0, 2.0), (0.0, 3.0), (0.0, 4.0))
    assert ks.need[0] == pytest.approx(5.0)
    # The FP4 budget over the same table weighs FP4 only (FP8 has no weight, so BF16 beats it).
    ks4, _ = build_knapsack(CostTable.of(costs), flops, PlannerConfig(rho=0.3, allowed=THREE))
    assert ks4.weight[0] == (0.0, 1.0) and ks4.choices[0] == (P.BF16, P.FP4)


@pytest.mark.parametrize("solver", SOLVERS)
def test_the_dearest_linears_stay_bf16(solver):
    # FLOPs 2, 1, 1, 4 (total 8); 75% in FP8 leaves at most 2 FLOPs in BF16: keeping A (saves 1.0)
    # loses to keeping B and C (save 0.6 + 0.6), though A is the single dearest linear.
    a, b, c, d = all_keys(1)
    flops = {a: 2.0, b: 1.0, c: 1.0, d: 4.0}
    costs = {a: {P.BF16: 0.0, P.FP8: 1.0}, b: {P.BF16: 0.0, P.FP8: 0.6},
             c: {P.BF16: 0.0, P.FP8: 0.6}, d: {P.BF16: 0.0, P.FP8: 0.1}}
    r = solve_plan(costs, flops, fp8_config(0.75, solver=solver))
    assert dict(r.plan) == {a: P.FP8, b: P.BF16, c: P.BF16, d: P.FP8}
    assert r.objective == pytest.approx(1.1) and r.status == "optimal"
    assert r.achieved.fp8_fraction == pytest.approx(0.75) and r.achieved.fp4_fraction == 0.0
    # 16 equal linears at 75%: the four with the dearest FP8 stay BF16.
    keys = all_keys(4)
    q = np.random.default_rng(0).permutation(16) / 16 + 0.01
    r = solve_plan({k: {P.BF16: 0.0, P.FP8: float(v)} for k, v in zip(keys, q)}, {k: 1.0 for k in keys},
                   fp8_config(0.75, solver=solver))
    assert {k for k in keys if r.plan[k] is P.BF16} == {keys[i] for i in np.argsort(q)[-4:]}


def test_the_same_rho_counts_fp8_only_under_the_fp8_budget():
    keys = all_keys(2)
    flops = {k: 1.0 for k in keys}
    costs = {k: {P.BF16: 0.0, P.FP8: 0.1 * (i + 1)} for i, k in enumerate(keys)}
    r = solve_plan(costs, flops, fp8_config(0.5))
    assert r.achieved.fp8_fraction == pytest.approx(0.5) and r.achieved.fp4_fraction == 0.0
    assert {k for k in keys if r.plan[k] is P.FP8} == set(keys[:4])
    # Under the FP4 budget the same rho over the same BF16/FP8 table counts nothing.
    with pytest.raises(ValueError, match=r"infeasible budget: rho=0.5 but the largest achievable rho .* is 0$"):
        solve_plan(costs, flops, PlannerConfig(rho=0.5, allowed=HOPPER))


@pytest.mark.parametrize("solver", SOLVERS)
def test_pins_count_by_their_precision(solver):
    keys = all_keys(2)  # 8 linears of 1 FLOP; 50% in FP8 or lower = 4 linears
    flops = {k: 1.0 for k in keys}
    q = [0.8, 0.3, 0.5, 0.1, 0.9, 0.2, 0.7, 0.4]
    costs = {k: {P.BF16: 0.0, P.FP8: v} for k, v in zip(keys, q)}
    # The FP4 pin counts (FP4 is lower than FP8) on the dearest linear; the BF16 pin on the cheapest.
    pinned = {keys[4]: P.FP4, keys[3]: P.BF16}
    r = solve_plan(costs, flops, fp8_config(0.5, solver=solver), pinned=pinned)
    assert r.plan[keys[4]] is P.FP4 and r.plan[keys[3]] is P.BF16
    # Three more from the six free ones, the cheapest: 0.2, 0.3, 0.4. The FP4 pin has no cost entry.
    assert {k for k in keys if r.plan[k] is P.FP8} == {keys[5], keys[1], keys[7]}
    assert r.objective == pytest.approx(0.9)
    assert r.achieved.fp8_fraction == pytest.approx(0.5) and r.achieved.fp4_fraction == pytest.approx(0.125)


def test_per_stage_fp8_budget_binds_only_with_stages():
    keys = all_keys(4)
    flops = {k: 1.0 for k in keys}
    costs = {k: {P.BF16: 0.0, P.FP8: 0.1 if k.layer <= 2 else 1.0} for k in keys}
    stages = stages_for_keys(keys, stage_of_layers(4, 2))
    config = fp8_config(0.5)
    glob = solve_plan(costs, flops, config)
    assert all(glob.plan[k] is (P.FP8 if k.layer <= 2 else P.BF16) for k in keys)
    staged = solve_plan(costs, flops, config, stages=stages)
    exact = solve_plan(costs, flops, replace(config, solver="exact"), stages=stages)
    for r in (staged, exact):
        assert r.per_stage[0].fp8_fraction == pytest.approx(0.5)
        assert r.per_stage[1].fp8_fraction == pytest.approx(0.5)
        assert r.objective == pytest.approx(4 * 0.1 + 4 * 1.0)
    off = solve_plan(costs, flops, replace(config, per_stage=False), stages=stages)
    assert off.plan == glob.plan and off.per_stage[1].fp8_fraction == 0.0


def test_infeasible_fp8_budget_names_it_in_its_units():
    keys = all_keys(2)
    flops = {k: 1.0 for k in keys}
    costs = {k: {P.BF16: 0.0, P.FP8: 1.0} for k in keys}
    pinned = {LayerKey(1, "linear_qkv"): P.BF16}
    with pytest.raises(ValueError, match=r"infeasible budget: rho=0.9 \(the fraction of linear FLOPs in FP8 "
                                         r"or lower\) but the largest achievable rho .* is 0\.875$"):
        solve_plan(costs, flops, fp8_config(0.9), pinned=pinned)
    stages = {k: k.layer - 1 for k in keys}
    with pytest.raises(ValueError, match=r"is 0\.75 \(limited by pipeline stage 0\)"):
        solve_plan(costs, flops, fp8_config(0.8), pinned=pinned, stages=stages)
    with pytest.raises(ValueError, match=r"rho=0.5 \(the fraction .* allowed=\['bf16'\] .* is 0$"):
        solve_plan(costs, flops, fp8_config(0.5, ("bf16",)))
    # Just feasible is feasible, by both solvers.
    for solver in SOLVERS:
        r = solve_plan(costs, flops, fp8_config(0.875, solver=solver), pinned=pinned)
        assert r.achieved.fp8_fraction == 0.875 and r.status == "optimal"


def test_real_shapes_fit_the_exact_integer_dp():
    flops = flop_table(get_shape("llama_70b"))
    rng = np.random.default_rng(0)
    costs = CostTable({k: {P.BF16: 0.0, P.FP8: rng.random(), P.FP4: rng.random()} for k in flops})
    for allowed in (HOPPER, THREE):
        ks, _ = build_knapsack(costs, flops, fp8_config(0.9, allowed))
        units = _integer_units(ks.weight, ks.need[0], PlannerConfig().exact_max_states)
        assert units is not None and units[1] < 20_000
    stages = stages_for_keys(flops, stage_of_layers(80, 8))
    r = solve_plan(costs, flops, fp8_config(0.9, solver="exact"), stages=stages)
    assert r.status == "optimal" and r.seconds < 2
    assert min(a.fp8_fraction for a in r.per_stage.values()) >= 0.9 - 1e-9


def test_discretised_fp8_budget_says_feasible():
    keys = all_keys(6)
    rng = np.random.default_rng(3)
    flops = {k: float(rng.random() + 0.1) * math.pi for k in keys}
    costs = {k: {P.BF16: 0.0, P.FP8: float(rng.random())} for k in keys}
    r = solve_plan(costs, flops, fp8_config(0.6, solver="exact", exact_max_states=32))
    assert r.solver == "exact" and r.status == "feasible" and r.achieved.fp8_fraction >= 0.6 - 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_random_pinned_fp8_instances_agree_with_brute_force(seed):
    rng = np.random.default_rng(200 + seed)
    n = int(rng.integers(4, 10))
    allowed = (HOPPER, THREE)[seed % 2]
    keys = all_keys(math.ceil(n / 4))[:n]
    flops = {k: float(rng.choice([2, 3, 5, 8, 13]) * 1000) for k in keys}
    costs = {}
    for k in keys:
        costs[k] = {P.BF16: 0.0, P.FP8: float(rng.random()), P.FP4: float(rng.random())}  # either dearer
    pinned = {keys[int(rng.integers(n))]: P.parse(rng.choice(["bf16", "fp8", "fp4"]))}
    stages = {k: int(rng.integers(2)) for k in keys} if seed % 3 else None
    target = float(rng.uniform(0.3, 0.8))
    # Brute force over every combination, against the budget's definition.
    options = [[pinned[k]] if k in pinned else list(allowed) for k in keys]
    stage = stages or {k: 0 for k in keys}
    groups = [[k for k in keys if stage[k] == s] for s in set(stage.values())]
    best = math.inf
    for combo in np.ndindex(*[len(o) for o in options]):
        plan = {k: o[i] for k, o, i in zip(keys, options, combo)}
        if all(sum(flops[k] for k in g if plan[k] is not P.BF16) >= target * sum(flops[k] for k in g) * (1 - 1e-9)
               for g in groups):
            best = min(best, sum(costs[k][p] for k, p in plan.items()))
    config = fp8_config(target, allowed)
    if not math.isfinite(best):
        with pytest.raises(ValueError, match=r"infeasible budget: rho=.* \(the fraction of linear FLOPs in FP8 or lower\)"):
            solve_plan(costs, flops, config, stages=stages, pinned=pinned)
        return
    for solver in SOLVERS:
        r = solve_plan(costs, flops, replace(config, solver=solver), stages=stages, pinned=pinned)
        assert r.objective == pytest.approx(best, rel=1e-6, abs=1e-9), solver
        assert all(r.plan[k] is p for k, p in pinned.items())
        assert set(r.plan.values()) <= set(allowed) | set(pinned.values())
