import pytest
import torch

from snip_megatron.formats import (
    FP4_RECIPES, FP8_RECIPES, CastConfig, ElementFormat, FormatSpec, Precision, Role, Rounding,
    ScaleFormat,
)


def test_recipe_names_and_defaults():
    assert FP8_RECIPES == ("blockwise", "tensorwise", "mxfp8")
    assert FP4_RECIPES == ("nvfp4", "mxfp4")
    assert FormatSpec.for_precision("fp8").recipe == "blockwise"
    assert FormatSpec.for_precision(Precision.FP4).recipe == "nvfp4"
    bf16 = FormatSpec.for_precision("bf16")
    assert not bf16.is_quantized and all(bf16.cast(r) is None for r in Role)


@pytest.mark.parametrize("kw,listed", [({"fp8_recipe": "delayed"}, "blockwise, tensorwise, mxfp8"),
                                       ({"fp4_recipe": "fp4"}, "nvfp4, mxfp4")])
def test_unknown_recipe_lists_valid(kw, listed):
    with pytest.raises(ValueError, match=listed):
        FormatSpec.for_precision("fp8", **kw)


def test_unknown_precision():
    with pytest.raises(ValueError, match="bf16, fp8, fp4"):
        FormatSpec.for_precision("int8")


def test_nvfp4_roles():
    s = FormatSpec.for_precision("fp4")
    assert s.fprop_input.block == (1, 16) and s.fprop_weight.block == (16, 16)
    assert s.dgrad_weight == s.fprop_weight  # one 16x16 weight serves both GEMMs
    for r in (Role.DGRAD_GRAD_OUTPUT, Role.WGRAD_GRAD_OUTPUT):
        assert s.cast(r).rounding is Rounding.STOCHASTIC
    for r in (Role.FPROP_INPUT, Role.FPROP_WEIGHT, Role.WGRAD_INPUT):
        assert s.cast(r).rounding is Rounding.NEAREST_EVEN
    assert [r for r in Role if s.cast(r).hadamard] == [Role.WGRAD_GRAD_OUTPUT, Role.WGRAD_INPUT]
    assert all(s.cast(r).scale is ScaleFormat.E4M3 and s.cast(r).tensor_scale for r in Role)


def test_fp8_recipes_roles():
    bw = FormatSpec.for_precision("fp8")
    assert bw.fprop_input.block == (1, 128) and bw.fprop_weight.block == (128, 128)
    tw = FormatSpec.for_precision("fp8", fp8_recipe="tensorwise")
    assert tw.fprop_input.element is ElementFormat.E4M3 and tw.fprop_weight.element is ElementFormat.E4M3
    assert tw.dgrad_grad_output.element is ElementFormat.E5M2
    assert tw.wgrad_grad_output.element is ElementFormat.E5M2
    assert tw.wgrad_input.element is ElementFormat.E4M3 and tw.fprop_input.block is None
    mx = FormatSpec.for_precision("fp8", fp8_recipe="mxfp8")
    assert all(mx.cast(r).block == (1, 32) and mx.cast(r).scale is ScaleFormat.E8M0 for r in Role)


def test_role_layout():
    assert [r.contraction_dim for r in Role] == [-1, -1, -1, 0, 0, 0]
    assert Role.WGRAD_INPUT.gemm == "wgrad" and Role.WGRAD_INPUT.operand == "input"
    assert Role.DGRAD_GRAD_OUTPUT.operand == "grad_output"


def test_gemm_operands_must_agree():
    nv = FormatSpec.for_precision("fp4")
    fp8 = CastConfig(element=ElementFormat.E4M3, block=(1, 128))
    with pytest.raises(ValueError, match="fprop operands disagree"):
        FormatSpec(precision=Precision.FP4, recipe="x", **{**_roles(nv), "fprop_input": fp8})
    with pytest.raises(ValueError, match="quantizes only one operand"):
        FormatSpec(precision=Precision.FP4, recipe="x", **{**_roles(nv), "wgrad_input": None})


def _roles(spec):
    return {r.value: spec.cast(r) for r in Role}


@pytest.mark.parametrize("kw,msg", [
    (dict(element=ElementFormat.E4M3, block=(1, 0)), "block"),
    (dict(element=ElementFormat.E4M3, block=None, scale=ScaleFormat.E8M0), "needs a block"),
    (dict(element=ElementFormat.E2M1, block=(1, 16), scale=ScaleFormat.E4M3), "tensor_scale"),
    (dict(element=ElementFormat.E4M3, block=(1, 16), rounding=Rounding.STOCHASTIC), "e2m1 only"),
    (dict(element=ElementFormat.E2M1, block=(1, 16), hadamard=32), "hadamard"),
])
def test_cast_config_rejects(kw, msg):
    with pytest.raises(ValueError, match=msg):
        CastConfig(**kw)


def test_short_str():
    s = FormatSpec.for_precision("fp4")
    assert s.wgrad_grad_output.short_str() == "e2m1 1x16 e4m3*fp32 sr h16"
    assert s.short_str().startswith("fp4:nvfp4 fprop=[e2m1 1x16 e4m3*fp32 | e2m1 16x16 e4m3*fp32]")
    assert FormatSpec.for_precision("bf16").short_str() == "bf16"
    assert "tensor" in FormatSpec.for_precision("fp8", fp8_recipe="tensorwise").short_str()
