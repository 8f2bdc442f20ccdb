"""Precision -> Transformer Engine per-module config, checked against Megatron's own parser and
its per-module autocast logic (with a stand-in for TE's recipe classes: TE is not on CPU)."""

from __future__ import annotations

import types

import pytest

from snip_megatron.formats.precision import Precision
from snip_megatron.te import (TEOptions, check_transformer_config, default_fp8_recipe,
                              emulated_params, has_native_fp4, module_config,
                              precision_of_te_params, te_config_dict, te_params)

# Imports without TE installed (its TE-only names are absent); the parser and autocast logic are here.
import megatron.core.extensions.transformer_engine as te_ext  # noqa: E402
from megatron.core.quantization.quant_config import MatchContext, QuantizationConfig  # noqa: E402

H100, B200 = 90, 100


def parse(config: dict):
    """What a TE linear's finish_init does with the config dict."""
    qc = QuantizationConfig(config, MatchContext("decoder.layers.0.mlp.linear_fc1", 0), "k")
    return te_ext.TEQuantizationParams.parse_from_config(qc)


@pytest.mark.parametrize("sm, precision, fp8, fp4", [
    (H100, "fp8", "blockwise", None),
    (B200, "fp8", "mxfp8", None),
    (B200, "fp4", None, "nvfp4"),
    (H100, "bf16", None, None),
    (B200, "bf16", None, None),
    (89, "fp8", "tensorwise", None),
])
def test_megatron_parses_each_translation(sm, precision, fp8, fp4):
    params = parse(te_params(precision, sm=sm))
    recipe = params.training_recipe
    assert recipe.fp8_quantization_recipe == fp8 and recipe.fp4_quantization_recipe == fp4
    assert recipe.override_quantized_autocast and recipe.override_nonquantized_autocast
    assert params.evaluation_recipe is None
    assert precision_of_te_params(params) is Precision.parse(precision)
    assert precision_of_te_params(te_params(precision, sm=sm)) is Precision.parse(precision)


@pytest.mark.parametrize("global_quantized", [False, True])
@pytest.mark.parametrize("precision", list(Precision))
def test_module_runs_its_precision_whether_or_not_global_fp8_is_on(precision, global_quantized):
    params = parse(te_params(precision, sm=B200))
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
@pytest.mark.parametrize("sm, precision, recipe_class", [
    (H100, "fp8", "Float8BlockScaling"), (B200, "fp8", "MXFP8BlockScaling"),
    (B200, "fp4", "NVFP4BlockScaling"), (H100, "bf16", None),
])
def test_autocast_opened_for_each_translation(monkeypatch, global_on, sm, precision, recipe_class):
    _fake_te(monkeypatch, global_on)
    ctx = te_ext._get_fp8_autocast_for_quant_params(parse(te_params(precision, sm=sm)), True)
    _, enabled, recipe = ctx
    if recipe_class is None:  # BF16: autocast explicitly disabled, under a global one or not
        assert enabled is False and recipe is None
    else:
        assert enabled is True and type(recipe).__name__ == recipe_class


def test_fp4_without_native_kernels_goes_to_the_emulated_linear():
    assert not has_native_fp4(H100) and has_native_fp4(B200)
    mc = module_config("fp4", sm=H100)
    assert mc.backend == "emulated" and mc.config == {"precision": "fp4", "fp4_recipe": "nvfp4"}
    assert mc.config == emulated_params("fp4")
    assert module_config("fp4", sm=B200).backend == "te"
    assert {k: v.backend for k, v in te_config_dict(sm=H100).items()} == {
        "bf16": "te", "fp8": "te", "fp4": "emulated"}
    with pytest.raises(ValueError, match="fp4_fallback='error'"):
        module_config("fp4", sm=H100, options=TEOptions(fp4_fallback="error"))
    with pytest.raises(ValueError, match="needs SM100"):
        te_params("fp4", sm=H100)


def test_fp8_recipe_is_configurable_and_checked_against_the_gpu():
    assert default_fp8_recipe(H100) == "blockwise" and default_fp8_recipe(B200) == "mxfp8"
    tw = te_params("fp8", sm=B200, options=TEOptions(fp8_recipe="tensorwise", fp8_format="hybrid"))
    assert parse(tw).training_recipe.fp8_quantization_recipe == "tensorwise"
    assert tw["training_recipe"]["fp8_format"] == "hybrid"
    assert te_params("fp8", sm=B200, options=TEOptions(fp8_recipe="blockwise"))[
        "training_recipe"]["fp8_quantization_recipe"] == "blockwise"
    with pytest.raises(ValueError, match="'mxfp8' needs SM100"):
        te_params("fp8", sm=H100, options=TEOptions(fp8_recipe="mxfp8"))
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        te_params("fp8", sm=80)
    with pytest.raises(ValueError, match="compute capability must be an int"):
        te_params("fp8", sm="9.0")


@pytest.mark.parametrize("kwargs, words", [
    (dict(fp8_recipe="delayed"), "fp8_recipe='delayed' cannot switch per layer"),
    (dict(fp8_recipe="custom"), "fp8_recipe='custom' cannot switch"),
    (dict(fp8_recipe="fp8ish"), "fp8_recipe='fp8ish' is unknown"),
    (dict(fp4_recipe="mxfp4"), "fp4_recipe='mxfp4' has no Transformer Engine recipe"),
    (dict(fp4_fallback="fp8"), "fp4_fallback='fp8' is unknown"),
    (dict(fp8_format="e5m2"), "fp8_format='e5m2' is unknown"),
])
def test_bad_options_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TEOptions(**kwargs)


def test_megatron_itself_rejects_delayed_per_module():
    bad = te_params("fp8", sm=H100)
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
