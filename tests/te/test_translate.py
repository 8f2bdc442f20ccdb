"""Precision -> Transformer Engine per-module config, from the run's one Formats value, per GPU
generation: checked against Megatron's own parser and its per-module autocast logic (with a
stand-in for TE's recipe classes: TE is not on CPU), and the start-up resolution of the formats
against what TE runs on each GPU with the environment TE reads."""

from __future__ import annotations

import types

import pytest

from snip_megatron.config import SnipConfig
from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.te import (TEOptions, check_transformer_config, emulated_params, fp4_unavailable, gemm_cost,
                              generation, precision_of_te_params, te_config_dict, te_formats, te_params,
                              te_unavailable, what_runs)

# Imports without TE installed (its TE-only names are absent); the parser and autocast logic are here.
import megatron.core.extensions.transformer_engine as te_ext  # noqa: E402
from megatron.core.quantization.quant_config import MatchContext, QuantizationConfig  # noqa: E402

H100, B200 = 90, 100
DEFAULT = Formats()


def parse(config: dict):
    """What a TE linear's finish_init does with the config dict."""
    qc = QuantizationConfig(config, MatchContext("decoder.layers.0.mlp.linear_fc1", 0), "k")
    return te_ext.TEQuantizationParams.parse_from_config(qc)


@pytest.mark.parametrize("sm, precision, formats, fp8, fp8_format, fp4", [
    (H100, "fp8", DEFAULT, "blockwise", "e4m3", None),
    (H100, "fp8", Formats(fp8_recipe="tensorwise"), "tensorwise", "hybrid", None),
    (H100, "fp8", Formats(fp8_recipe="tensorwise", fp8_format="e4m3"), "tensorwise", "e4m3", None),
    (H100, "fp8", Formats(fp8_format="hybrid", fp8_block_scales="pow2"), "blockwise", "hybrid", None),
    (B200, "fp8", Formats(fp8_recipe="mxfp8"), "mxfp8", "e4m3", None),
    (B200, "fp8", DEFAULT, "blockwise", "e4m3", None),
    (B200, "fp4", DEFAULT, None, "e4m3", "nvfp4"),
    (H100, "bf16", DEFAULT, None, "e4m3", None),
    (B200, "bf16", DEFAULT, None, "e4m3", None),
    (89, "fp8", Formats(fp8_recipe="tensorwise"), "tensorwise", "hybrid", None),
])
def test_megatron_parses_each_translation(sm, precision, formats, fp8, fp8_format, fp4):
    params = parse(te_params(precision, formats=formats, sm=sm))
    recipe = params.training_recipe
    assert recipe.fp8_quantization_recipe == fp8 and recipe.fp4_quantization_recipe == fp4
    assert recipe.fp8_format == fp8_format  # Megatron's default e4m3 where no FP8 is set
    assert recipe.custom_recipe_factory is None  # never TE's Python reference quantizer
    assert recipe.override_quantized_autocast and recipe.override_nonquantized_autocast
    assert params.evaluation_recipe is None
    assert precision_of_te_params(params) is Precision.parse(precision)
    assert precision_of_te_params(te_params(precision, formats=formats, sm=sm)) is Precision.parse(precision)


def test_hopper_has_no_te_fp4_dict():
    """Before SM100 SNIP's TE backend has no FP4: no dict names TE's reference quantizer."""
    with pytest.raises(ValueError, match=r"FP4 nvfp4: TE's NVFP4 kernels need SM100\+"):
        te_params("fp4", formats=DEFAULT, sm=H100)
    assert "fp4" not in te_config_dict(formats=DEFAULT, sm=H100)
    assert "plans BF16 and FP8" in te_unavailable(formats=DEFAULT, sm=H100)["fp4"]


@pytest.mark.parametrize("global_quantized", [False, True])
@pytest.mark.parametrize("sm, precision", [(sm, p) for sm in (H100, B200) for p in Precision
                                            if (sm, p) != (H100, Precision.FP4)])
def test_module_runs_its_precision_whether_or_not_global_fp8_is_on(precision, global_quantized, sm):
    params = parse(te_params(precision, formats=DEFAULT, sm=sm))
    quantized = te_ext._get_should_context_be_quantized_params(params, True, global_quantized)
    assert quantized == (precision is not Precision.BF16)


class _Recipe:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


def _fake_te(monkeypatch, global_on: bool):
    """Stand-ins for the TE names Megatron's per-module autocast uses, recording what it opens."""
    names = ("Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling")
    recipe_ns = types.SimpleNamespace(Format=types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID"),
                                      **{n: type(n, (_Recipe,), {}) for n in names})
    monkeypatch.setattr(te_ext, "te", types.SimpleNamespace(common=types.SimpleNamespace(recipe=recipe_ns)),
                        raising=False)
    monkeypatch.setattr(te_ext, "FP8GlobalStateManager",
                        types.SimpleNamespace(is_fp8_enabled=lambda: global_on), raising=False)
    monkeypatch.setattr(te_ext, "fp8_autocast",
                        lambda enabled, fp8_recipe=None, fp8_group=None: ("autocast", enabled, fp8_recipe),
                        raising=False)
    monkeypatch.setattr(te_ext, "model_parallel_is_initialized", lambda: False, raising=False)


@pytest.mark.parametrize("global_on", [False, True])
@pytest.mark.parametrize("sm, precision, formats, recipe_class, fmt", [
    (H100, "fp8", DEFAULT, "Float8BlockScaling", "E4M3"),
    (H100, "fp8", Formats(fp8_recipe="tensorwise"), "Float8CurrentScaling", "HYBRID"),
    (H100, "fp8", Formats(fp8_recipe="tensorwise", fp8_format="e4m3"), "Float8CurrentScaling", "E4M3"),
    (B200, "fp8", Formats(fp8_recipe="mxfp8"), "MXFP8BlockScaling", "E4M3"),
    (B200, "fp4", DEFAULT, "NVFP4BlockScaling", None), (H100, "bf16", DEFAULT, None, None),
])
def test_autocast_opened_for_each_translation(monkeypatch, global_on, sm, precision, formats, recipe_class, fmt):
    _fake_te(monkeypatch, global_on)
    ctx = te_ext._get_fp8_autocast_for_quant_params(parse(te_params(precision, formats=formats, sm=sm)), True)
    _, enabled, recipe = ctx
    if recipe_class is None:  # BF16: autocast explicitly disabled, under a global one or not
        assert enabled is False and recipe is None
    else:
        assert enabled is True and type(recipe).__name__ == recipe_class
        assert recipe.kwargs.get("fp8_format") == fmt


def test_what_each_generation_runs_and_refuses():
    assert fp4_unavailable("nvfp4", B200) is None and fp4_unavailable("nvfp4", 120) is None
    for sm in (H100, 89, 80):
        assert "NVFP4 kernels need SM100+" in fp4_unavailable("nvfp4", sm)
    assert "'mxfp4' has no Transformer Engine recipe" in fp4_unavailable("mxfp4", B200)
    assert set(te_config_dict(formats=DEFAULT, sm=H100)) == {"bf16", "fp8"}
    assert set(te_config_dict(formats=DEFAULT, sm=B200)) == {"bf16", "fp8", "fp4"}
    assert set(te_unavailable(formats=DEFAULT, sm=H100)) == {"fp4"} and te_unavailable(formats=DEFAULT, sm=B200) == {}
    mx = Formats(fp8_recipe="mxfp8", fp4_recipe="mxfp4")
    missing = te_unavailable(formats=mx, sm=H100)
    assert set(missing) == {"fp8", "fp4"} and "MXFP8 needs SM100" in missing["fp8"]
    assert set(te_config_dict(formats=mx, sm=H100)) == {"bf16"}
    assert te_unavailable(formats=Formats(fp8_recipe="mxfp8"), sm=B200) == {}
    assert "MXFP8 needs SM100-SM119" in te_unavailable(formats=Formats(fp8_recipe="mxfp8"), sm=120)["fp8"]
    assert "blockwise FP8 needs SM90" in te_unavailable(formats=DEFAULT, sm=89)["fp8"]
    assert "no FP8 tensor cores" in te_unavailable(formats=DEFAULT, sm=80)["fp8"]
    with pytest.raises(ValueError, match="compute capability must be an int"):
        te_params("fp8", formats=DEFAULT, sm="9.0")
    assert generation(90) == "SM90 (Hopper)" and generation(100) == "SM100 (Blackwell)"


def test_gemm_cost_says_what_the_gpu_runs():
    assert gemm_cost(H100) == {Precision.BF16: 1.0, Precision.FP8: 0.5, Precision.FP4: 1.0}  # FP4: never planned
    assert gemm_cost(B200) == {Precision.BF16: 1.0, Precision.FP8: 0.5, Precision.FP4: 0.25}


NO_ENV: dict = {}
FP32_SCALES = {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}


@pytest.mark.parametrize("sm, request_, environ, want", [
    # Unset variants follow TE: power-of-two block scales unless the switch is 1.
    (H100, {}, NO_ENV, Formats(fp8_block_scales="pow2")),
    (H100, {}, FP32_SCALES, Formats(fp8_block_scales="fp32")),
    (B200, {}, NO_ENV, Formats(fp8_block_scales="pow2", fp4_gradient_rounding="stochastic")),
    (B200, {}, {"NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "1"},
     Formats(fp8_block_scales="pow2", fp4_gradient_rounding="nearest")),
    (B200, {"fp8_block_scales": "pow2", "fp4_gradient_rounding": "stochastic"}, NO_ENV,
     Formats(fp8_block_scales="pow2", fp4_gradient_rounding="stochastic")),
    (H100, {"fp8_block_scales": "fp32"}, FP32_SCALES, Formats(fp8_block_scales="fp32")),
    (H100, {"fp8_recipe": "tensorwise", "fp8_format": "e4m3"}, NO_ENV,
     Formats(fp8_recipe="tensorwise", fp8_format="e4m3")),
    (B200, {"fp8_recipe": "mxfp8"}, FP32_SCALES, Formats(fp8_recipe="mxfp8", fp4_gradient_rounding="stochastic")),
])
def test_te_formats_follow_what_te_runs(sm, request_, environ, want):
    uses = ("bf16", "fp8") if sm < 100 else ("fp8", "fp4")  # no FP4 on Hopper's TE backend
    assert te_formats(sm=sm, environ=environ, uses=uses, **request_) == want


@pytest.mark.parametrize("sm, request_, environ, uses, words", [
    (H100, {"fp8_block_scales": "fp32"}, NO_ENV, None,
     "fp8_block_scales='fp32', but TE runs pow2 blockwise scales .NVTE_FP8_BLOCK_SCALING_FP32_SCALES=unset.; "
     "set NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"),
    (H100, {"fp8_block_scales": "pow2"}, FP32_SCALES, None, "unset NVTE_FP8_BLOCK_SCALING_FP32_SCALES"),
    (B200, {}, FP32_SCALES, None, "emulates blockwise FP8 with MXFP8 GEMMs, which need power-of-two scales"),
    (H100, {}, NO_ENV, None, "fp4_recipe='nvfp4': TE's NVFP4 kernels need SM100.* drop fp4 from precisions.*"
     r"FP4 runs on SNIP's emulated linears \(--transformer-impl local\)"),
    (B200, {"fp4_gradient_rounding": "nearest"}, NO_ENV, None,
     "set NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1"),
    (B200, {}, {"NVTE_NVFP4_DISABLE_RHT": "1"}, None, "NVTE_NVFP4_DISABLE_RHT=1 turns off NVFP4's"),
    (B200, {}, {"NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "1"}, None, "16x16 weight tiles"),
    (H100, {"fp8_recipe": "tensorwise"}, {"NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "1"}, None,
     "tensorwise FP8 power-of-two scales"),
    (H100, {"fp8_recipe": "mxfp8"}, NO_ENV, None, "fp8_recipe='mxfp8': TE's MXFP8 needs SM100"),
    (B200, {"fp4_recipe": "mxfp4"}, NO_ENV, None, "fp4_recipe='mxfp4': .* no Transformer Engine recipe"),
    (80, {}, NO_ENV, ("fp4",), "NVFP4 kernels need SM100"),
    (80, {}, NO_ENV, ("fp8",), r"no FP8 tensor cores .TE needs SM89\+.; no FP8 recipe runs here"),
    (89, {}, NO_ENV, ("fp8",), "blockwise FP8 needs SM90.*; choose fp8_recipe tensorwise"),
])
def test_te_formats_refuse_what_te_would_not_run_with_the_fix(sm, request_, environ, uses, words):
    kwargs = {"uses": ("bf16", "fp8") if sm < 100 else ("fp8", "fp4")} if uses is None else {"uses": uses}
    if "fp4" in words or "NVFP4" in words:
        kwargs = {} if uses is None else kwargs
    with pytest.raises(ValueError, match=words):
        te_formats(sm=sm, environ=environ, **request_, **kwargs)


def test_an_unused_precision_is_not_checked():
    # MXFP4 has no TE recipe, MXFP8 no Hopper kernel: fine while the run never uses them.
    f = te_formats(fp8_recipe="mxfp8", fp4_recipe="mxfp4", sm=H100, uses=("bf16",), environ=NO_ENV)
    assert (f.fp8_recipe, f.fp4_recipe, f.fp4_gradient_rounding) == ("mxfp8", "mxfp4", None)
    with pytest.raises(ValueError) as err:  # both problems at once, one line each
        te_formats(fp8_recipe="mxfp8", fp4_recipe="mxfp4", sm=H100, environ=NO_ENV)
    assert str(err.value).count("\n  - ") == 2


def test_the_start_up_line_says_what_runs():
    hopper = te_formats(sm=H100, environ=NO_ENV, uses=("bf16", "fp8"))
    assert what_runs(hopper, H100, uses=("bf16", "fp8")) == \
        "SM90 (Hopper): FP8 blockwise (e4m3, pow2 scales) on TE kernels"
    assert what_runs(te_formats(sm=B200, environ=NO_ENV), B200) == (
        "SM100 (Blackwell): FP8 blockwise (e4m3, pow2 scales) on TE kernels via MXFP8 GEMMs; FP4 nvfp4 "
        "(stochastic gradient rounding) on TE's NVFP4 kernels")


def test_snipconfig_resolved_for_te_per_generation(monkeypatch):
    for name in ("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"):
        monkeypatch.delenv(name, raising=False)
    snip = SnipConfig(enabled=True)
    emulated = snip.resolved("emulated")
    assert (emulated.precisions, emulated.budget, emulated.fp4_budget) == (["fp8", "fp4"], "fp4_fraction", 0.75)
    assert emulated.formats == Formats() and emulated.resolved("emulated") == emulated
    # Hopper: --snip alone plans BF16/FP8 under an FP8 budget; FP4 is never asked of TE there.
    hopper = snip.resolved("te", sm=H100)
    assert (hopper.precisions, hopper.budget, hopper.fp8_budget, hopper.fp4_budget) == \
        (["bf16", "fp8"], "fp8_fraction", 0.9, None)
    assert hopper.formats == Formats(fp8_block_scales="pow2") and hopper.uses == (Precision.BF16, Precision.FP8)
    assert hopper.planner_config().budget == "fp8_fraction" and hopper.planner_config().fraction == 0.9
    assert hopper.measure_config().precisions == ("fp8",)
    assert hopper.budget_str() == ("plan budget >= 90% of linear FLOPs in FP8, from bf16,fp8 "
                                   "(GEMM cost bf16=1,fp8=0.5)")
    assert SnipConfig(enabled=True, fp8_budget=0.6).resolved("te", sm=H100).planner_config().fraction == 0.6
    blackwell = snip.resolved("te", sm=B200)
    assert (blackwell.precisions, blackwell.budget) == (["fp8", "fp4"], "fp4_fraction")
    assert blackwell.formats == Formats(fp8_block_scales="pow2", fp4_gradient_rounding="stochastic")
    assert blackwell.gemm_cost == "bf16=1,fp8=0.5,fp4=0.25"
    # The one Formats value: its spec is what the estimator measures, its TE dict what TE runs.
    assert blackwell.measure_config().formats == blackwell.formats
    # A cost model the user gives is kept.
    assert SnipConfig(enabled=True, gemm_cost="bf16=1,fp8=0.6,fp4=0.3").resolved("te", sm=H100).gemm_cost == \
        "bf16=1,fp8=0.6,fp4=0.3"
    with pytest.raises(ValueError, match="SnipConfig.fp8_block_scales='fp32', but TE runs pow2"):
        SnipConfig(enabled=True, fp8_block_scales="fp32").resolved("te", sm=H100)
    with pytest.raises(ValueError, match="SnipConfig.fp4_recipe='mxfp4'"):
        SnipConfig(enabled=True, fp4_recipe="mxfp4").resolved("te", sm=B200)
    # Any FP4 request on Hopper's TE backend is refused with the fix, whichever setting makes it.
    for asked in (dict(fp4_budget=0.75), dict(precisions="fp8,fp4"), dict(budget="fp4_fraction"),
                  dict(fp4_recipe="mxfp4"), dict(fp4_gradient_rounding="nearest"), dict(initial_precision="fp4",
                                                                                      precisions="bf16,fp8,fp4")):
        with pytest.raises(ValueError, match=r"SnipConfig.fp4_recipe='\w+': .*SNIP's emulated linears"):
            SnipConfig(enabled=True, **asked).resolved("te", sm=H100)
        assert "fp4" in SnipConfig(enabled=True, **asked).resolved("emulated").precisions
    # bf16 vs fp8 for speed on Hopper, the flags of earlier releases: still what they were.
    fast = SnipConfig(enabled=True, precisions="bf16,fp8", budget="speedup", speedup=1.8,
                      initial_precision="fp8").resolved("te", sm=H100)
    assert fast.planner_config().budget == "speedup" and fast.planner_config().speedup == 1.8
    with pytest.raises(ValueError, match=r"SnipConfig.speedup=2.5 cannot be reached: .* gives 2.00x"):
        SnipConfig(enabled=True, precisions="bf16,fp8", budget="speedup", speedup=2.5).resolved("te", sm=H100)
    assert SnipConfig(enabled=True, precisions="fp8,fp4", budget="speedup", speedup=2.5).resolved(
        "te", sm=B200).gemm_cost.endswith("fp4=0.25")


def test_emulated_params_and_options():
    assert emulated_params("fp4") == {"precision": "fp4", "fp4_recipe": "nvfp4"}
    assert emulated_params("bf16") == {"precision": "bf16"}
    tp_only = te_params("fp8", formats=DEFAULT, sm=H100, options=TEOptions(tp_only_amax_red=True))
    assert parse(tp_only).training_recipe.tp_only_amax_red is True
    with pytest.raises(ValueError, match="tp_only_amax_red must be True or False"):
        TEOptions(tp_only_amax_red="yes")


def test_megatron_itself_rejects_delayed_per_module():
    bad = te_params("fp8", formats=DEFAULT, sm=H100)
    bad["training_recipe"]["fp8_quantization_recipe"] = "delayed"
    with pytest.raises(ValueError, match="Delayed scaling"):
        parse(bad)


@pytest.mark.parametrize("fields, words", [
    (dict(fp8="e4m3", fp8_recipe="delayed"), "delayed scaling"),
    (dict(fp8="e4m3", fp8_recipe="blockwise", fp8_param=True), "fp8_param=True .--fp8-param-gather"),
    (dict(fp4="e2m1", fp4_param=True), "fp4_param=True .--fp4-param-gather"),
])
def test_transformer_config_that_cannot_switch_is_refused(fields, words):
    with pytest.raises(ValueError, match=words):
        check_transformer_config(types.SimpleNamespace(**fields))


def test_transformer_config_with_per_layer_friendly_settings_passes():
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8="e4m3",
                               fp8_recipe="blockwise")
    check_transformer_config(config)  # no error
    check_transformer_config(types.SimpleNamespace(fp8=None, fp8_recipe="delayed"))  # fp8 off
