"""SnipConfig: defaults, validation that names the field, warm-up, dict round trip."""

import pytest

from snip_megatron.config import BASELINES, SnipConfig
from snip_megatron.formats.precision import Formats, Precision


def test_defaults_are_the_papers_setting():
    cfg = SnipConfig()
    assert cfg.enabled is False
    # Unset, the plan's precisions and budget follow what the linears run: the paper's where FP4
    # runs (SNIP's emulated linears; TE on Blackwell, tests/te/test_translate.py has Hopper's).
    assert (cfg.precisions, cfg.budget, cfg.fp4_budget) == (None, None, None)
    c = cfg.plan_choices()
    assert (c.precisions, c.budget, c.fp4_budget, c.fp8_budget) == (["fp8", "fp4"], "fp4_fraction", 0.75, None)
    assert cfg.planner_config().fraction == 0.75 and cfg.uses == (Precision.FP8, Precision.FP4)
    assert cfg.initial_precision == "fp8"
    assert cfg.fp8_recipe == "blockwise" and cfg.fp4_recipe == "nvfp4"
    assert not cfg.measures  # off


@pytest.mark.parametrize("changes, field", [
    ({"fp4_budget": 1.5}, "fp4_budget"),
    ({"fp4_budget": -0.1}, "fp4_budget"),
    ({"fp4_budget": float("nan")}, "fp4_budget"),
    ({"interval": 0}, "interval"),
    ({"interval": 2.5}, "interval"),
    ({"lag": -1}, "lag"),
    ({"lag": 100, "interval": 100}, "lag"),
    ({"warmup": -1}, "warmup"),
    ({"warmup": 10.5}, "warmup"),
    ({"fp8_budget": 1.5}, "fp8_budget"),
    ({"fp8_budget": 0.9, "fp4_budget": 0.5}, "budget"),
    ({"fp8_budget": 0.9, "budget": "fp4_fraction"}, "fp8_budget"),
    ({"fp4_budget": 0.9, "precisions": "bf16,fp8"}, "fp4_budget"),
    ({"fp4_budget": 0.9, "budget": "speedup"}, "fp4_budget"),
    ({"budget": "fp4_fraction", "precisions": "bf16,fp8"}, "precisions"),
    ({"budget": "fp8_fraction", "baseline": "random"}, "baseline"),
    ({"precisions": "bf16,fp8", "fp4_recipe": "mxfp4"}, "fp4_recipe"),  # an FP4 setting no plan would use
    ({"precisions": "bf16,fp8", "fp4_gradient_rounding": "nearest"}, "fp4_gradient_rounding"),
    ({"precisions": ["fp8", "fp16"]}, "precisions"),
    ({"precisions": ["fp8"]}, "precisions"),
    ({"precisions": ["fp4"]}, "precisions"),
    ({"fp8_recipe": "delayed"}, "fp8_recipe"),
    ({"fp4_recipe": "int4"}, "fp4_recipe"),
    ({"initial_precision": "fp16"}, "initial_precision"),
    ({"initial_precision": "bf16", "precisions": ["fp8", "fp4"], "baseline": "nope"}, "baseline"),
    ({"pin_plan": True}, "pin_plan"),
    ({"plan": "p.json", "pin_plan": True, "baseline": "random"}, "pin_plan"),
    ({"baseline_fraction": 2.0}, "baseline_fraction"),
    ({"lambda_wd": -1.0}, "lambda_wd"),
    ({"switch_penalty": -0.5}, "switch_penalty"),
    ({"solver_time_limit_s": 0}, "solver_time_limit_s"),
    ({"solver_gap": 1.0}, "solver_gap"),
    ({"noise_scale": 0.0}, "noise_scale"),
    ({"loss_guard_factor": 0.5}, "loss_guard_factor"),
    ({"loss_guard_window": 0}, "loss_guard_window"),
    ({"enabled": "yes"}, "enabled"),
    ({"budget": "time"}, "budget"),
    ({"speedup": 0.5}, "speedup"),
    ({"budget": "speedup", "speedup": 5.0}, "speedup"),  # all-FP4 reaches 4x in the default model
    ({"budget": "speedup", "baseline": "random"}, "baseline"),
    ({"gemm_cost": "bf16=1,fp8=0.5"}, "gemm_cost"),
    ({"gemm_cost": "bf16=1,fp8=-1,fp4=1"}, "gemm_cost"),
    ({"gemm_cost": "fast"}, "gemm_cost"),
    ({"fp8_format": "e5m2"}, "fp8_format"),
    ({"fp8_recipe": "mxfp8", "fp8_format": "hybrid"}, "fp8_format"),
    ({"fp8_recipe": "tensorwise", "fp8_block_scales": "pow2"}, "fp8_block_scales"),
    ({"fp4_recipe": "mxfp4", "fp4_gradient_rounding": "stochastic"}, "fp4_gradient_rounding"),
])
def test_bad_values_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"SnipConfig\.{field}"):
        SnipConfig(**changes)


def test_initial_precision_must_be_a_choice_or_bf16():
    SnipConfig(initial_precision="bf16")  # BF16 is always allowed
    with pytest.raises(ValueError, match="initial_precision='fp8' is not one of"):
        SnipConfig(precisions=["bf16", "fp4"])


def test_a_speedup_budget_plans_without_fp4():
    cfg = SnipConfig(precisions="bf16,fp8", budget="speedup", speedup=1.8)
    p = cfg.planner_config()
    assert (p.budget, p.speedup, [x.value for x in p.allowed_precisions()]) == ("speedup", 1.8, ["bf16", "fp8"])
    assert p.gemm_costs() == cfg.gemm_costs() and cfg.gemm_cost is None
    with pytest.raises(ValueError, match="SnipConfig.precisions=.* must include fp4: the FP4 budget needs it"):
        SnipConfig(precisions="bf16,fp8", budget="fp4_fraction")
    with pytest.raises(ValueError, match="speedup=2.1 cannot be reached: every linear in the fastest of bf16,fp8"):
        SnipConfig(precisions="bf16,fp8", budget="speedup", speedup=2.1)
    assert "modelled linear-GEMM speed-up >= 1.8x" in cfg.budget_str()
    assert SnipConfig().budget_str() == ("plan budget >= 75% of linear FLOPs in FP4, from fp8,fp4 (GEMM cost "
                                         "bf16=1,fp8=0.5,fp4=0.25)")


def test_an_fp8_budget_plans_bf16_against_fp8():
    """Without fp4 in the precisions, or with fp8_budget set, the budget is the FP8 fraction."""
    for cfg in (SnipConfig(precisions="bf16,fp8"), SnipConfig(precisions="bf16,fp8", fp8_budget=0.8),
                SnipConfig(fp8_budget=0.8, precisions="bf16,fp8,fp4")):
        p = cfg.planner_config()
        assert p.budget == "fp8_fraction" and p.fraction == (0.9 if cfg.fp8_budget is None else 0.8), cfg
    assert SnipConfig(precisions="bf16,fp8").measure_config().precisions == ("fp8",)  # no FP4 errors measured
    assert SnipConfig(precisions="bf16,fp8", fp8_budget=0.8).budget_str() == (
        "plan budget >= 80% of linear FLOPs in FP8, from bf16,fp8 (GEMM cost bf16=1,fp8=0.5)")
    assert "in FP8 or FP4, from bf16,fp8,fp4" in SnipConfig(fp8_budget=0.8, precisions="bf16,fp8,fp4").budget_str()


def test_gemm_cost_is_parsed_and_kept_canonical():
    cfg = SnipConfig(gemm_cost=" FP4=0.3, bf16=1 ,fp8=0.5")
    assert cfg.gemm_cost == "bf16=1,fp8=0.5,fp4=0.3"
    assert cfg.planner_config().gemm_costs()[Precision.FP4] == 0.3
    assert SnipConfig.from_dict(cfg.to_dict()) == cfg


def test_format_variants_reach_the_one_formats_value():
    cfg = SnipConfig(fp8_recipe="tensorwise", fp8_format="e4m3", fp4_gradient_rounding="nearest")
    assert cfg.formats == Formats(fp8_recipe="tensorwise", fp8_format="e4m3", fp4_gradient_rounding="nearest")
    assert cfg.measure_config().formats == cfg.formats
    assert SnipConfig(fp8_block_scales="pow2").formats.fp8_block_scales == "pow2"
    assert SnipConfig().formats == Formats()  # unset variants: the recipes' own, unchanged


def test_precisions_are_parsed_and_ordered():
    assert SnipConfig(precisions="FP4, bf16,fp8").precisions == ["bf16", "fp8", "fp4"]
    assert SnipConfig(precisions=("fp4", "fp8", "fp4")).precisions == ["fp8", "fp4"]


@pytest.mark.parametrize("warmup, train_iters, expected", [(0.2, 1000, 200), (0.0, 50, 0), (300, 1000, 300),
                                                           (300.0, None, 300)])
def test_warmup_is_a_fraction_or_a_step_count(warmup, train_iters, expected):
    assert SnipConfig(warmup=warmup).warmup_steps(train_iters) == expected


def test_fractional_warmup_needs_the_run_length():
    with pytest.raises(ValueError, match="train_iters"):
        SnipConfig(warmup=0.2).warmup_steps(None)


def test_measures_only_for_adaptive_runs():
    assert SnipConfig(enabled=True).measures
    assert not SnipConfig(enabled=True, baseline="uniform_fp4").measures
    assert not SnipConfig(enabled=True, plan="p.json", pin_plan=True).measures


def test_every_baseline_name_is_accepted():
    for name in BASELINES:
        cfg = SnipConfig(enabled=True, baseline=name)
        assert cfg.baseline == name and cfg.plan_choices().budget == "fp4_fraction"


def test_dict_round_trip_and_unknown_keys():
    cfg = SnipConfig(enabled=True, fp4_budget=0.8, precisions=["bf16", "fp8", "fp4"], plan="x.json")
    assert SnipConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown SnipConfig field.*fp4budget"):
        SnipConfig.from_dict({"fp4budget": 0.5})


def test_snipconfig_builds_every_component_config_from_its_own_fields():
    cfg = SnipConfig(enabled=True, fp4_budget=0.6, precisions="bf16,fp8,fp4", per_stage_budget=True,
                     switch_penalty=0.1, solver_time_limit_s=7.0, solver_gap=1e-3, noise_scale=0.03, seed=5,
                     lambda_wd=0.7, fp8_recipe="mxfp8", fp4_recipe="mxfp4")
    m, e, p = cfg.measure_config(), cfg.estimate_config(), cfg.planner_config()
    assert (m.noise_frac, m.seed, m.formats) == (0.03, 5, cfg.formats)
    assert cfg.formats.fp8_recipe == "mxfp8" and cfg.formats.fp4_recipe == "mxfp4"
    assert e.lam == 0.7
    assert (p.fraction, [x.value for x in p.allowed_precisions()], p.per_stage, p.switch_penalty,
            p.time_limit_s, p.gap_rel) == (0.6, ["bf16", "fp8", "fp4"], True, 0.1, 7.0, 1e-3)


def test_component_defaults_equal_snipconfigs_or_say_that_snipconfig_sets_them():
    """A component config used outside a run keeps its own default; where that differs from what
    SnipConfig gives it in a run, the field's docstring must say so (no silent second default)."""
    from dataclasses import fields

    from snip_megatron.estimate.config import EstimateConfig
    from snip_megatron.flags import field_docs
    from snip_megatron.planner.config import PlannerConfig
    from snip_megatron.stats.config import MeasureConfig

    snip = SnipConfig(enabled=True)
    checked = 0
    for cls, built in ((MeasureConfig, snip.measure_config()), (EstimateConfig, snip.estimate_config()),
                       (PlannerConfig, snip.planner_config())):
        default, docs = cls(), field_docs(cls)
        for f in fields(cls):
            if getattr(built, f.name) != getattr(default, f.name):
                checked += 1
                assert "SnipConfig." in docs.get(f.name, ""), f"{cls.__name__}.{f.name}"
    assert checked >= 4  # noise, seed, per-stage budget, solver limit and gap differ today
