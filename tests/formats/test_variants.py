"""The recipe variants Transformer Engine runs besides our defaults: power-of-two blockwise scales
(TE Float8BlockScaling's default), E4M3-only tensorwise, E5M2-gradient blockwise, NVFP4 with
round-to-nearest gradients; `Formats` picks them, refuses combinations we do not emulate, and
leaves every default unchanged."""

import numpy as np
import pytest
import torch

from snip_megatron.formats import (
    CastConfig, ElementFormat, Formats, FormatSpec, Role, Rounding, ScaleFormat, quantize,
)

POW2 = Formats(fp8_block_scales="pow2").spec("fp8")


def _te_pow2_scale(amax: np.float32, fp8_max: float) -> np.float32:
    """TE's compute_scale_from_amax(amax, max, force_pow_2_scales=True, epsilon=0), written out
    on one float32: max / amax rounded to nearest, 1 for amax 0 (or non-finite), the largest
    float32 for an infinite quotient, then the mantissa bits cleared (bits & 0xFF800000)."""
    if amax == 0 or not np.isfinite(amax):
        return np.float32(1.0)
    with np.errstate(over="ignore"):
        scale = np.float32(fp8_max) / np.float32(amax)
    if np.isinf(scale):
        scale = np.finfo(np.float32).max
    bits = np.array([scale], dtype=np.float32).view(np.uint32) & np.uint32(0xFF800000)
    return bits.view(np.float32)[0]


def _te_blockwise_1x128(x: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    """Q(x) of TE's 1x128 blockwise quantizer with power-of-two scales, block by block."""
    dtype = torch.float8_e4m3fn if element is ElementFormat.E4M3 else torch.float8_e5m2
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], 128):
            block = x[r, c:c + 128]
            scale = _te_pow2_scale(np.float32(block.abs().max().item()), element.max)
            s = torch.tensor(float(scale), dtype=torch.float32)
            q = (block * s).clamp(-element.max, element.max).to(dtype).float()
            out[r, c:c + 128] = q * (1.0 / s)
    return out


def _data(rows=6, cols=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 6, cols)
    x[0, :128] = 0.0  # an all-zero block
    x[1, :128] = torch.linspace(-3e-30, 3e-30, 128)  # tiny: the quotient is still finite
    x[2, 128:256] *= 1e-38  # subnormal-sized amax: 448 / amax overflows float32
    return x


@pytest.mark.parametrize("element", [ElementFormat.E4M3, ElementFormat.E5M2])
def test_pow2_blockwise_equals_tes_rule_exactly(element):
    x = _data()
    cast = CastConfig(element=element, block=(1, 128), scale=ScaleFormat.POW2)
    assert torch.equal(quantize(x, cast, out_dtype=torch.float32), _te_blockwise_1x128(x, element))


def test_pow2_scales_are_fp32_scales_rounded_down():
    x = _data(seed=3)
    fp32 = quantize(x, Formats().spec("fp8").fprop_input, return_codes=True, out_dtype=torch.float32)
    pow2 = quantize(x, POW2.fprop_input, return_codes=True, out_dtype=torch.float32)
    encode_fp32, encode_pow2 = 1.0 / fp32.scales.double(), 1.0 / pow2.scales.double()
    mantissa, _ = np.frexp(encode_pow2.numpy())
    assert np.all(mantissa == 0.5)  # every scale is an exact power of two
    # (1 / decode recovers the FP32 encode scale only to float32 rounding, hence <= 2x.)
    assert torch.all(encode_pow2 <= encode_fp32) and torch.all(encode_fp32 <= 2 * encode_pow2)
    # Rounding the scale down never saturates: |x * scale| <= 448 before the cast.
    assert pow2.codes.float().abs().max() <= 448
    assert torch.equal(pow2.dequantized[0, :128], torch.zeros(128))


def test_pow2_weight_blocks_and_non_finite_values():
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    w[5, 7] = float("nan")
    qt = quantize(w, POW2.fprop_weight, return_codes=True, out_dtype=torch.float32)
    assert qt.scales.shape == (2, 2)
    assert torch.isnan(qt.dequantized[:128, :128]).all() and torch.isfinite(qt.dequantized[128:, :]).all()
    block = w[128:, 128:]
    scale = float(_te_pow2_scale(np.float32(block.abs().max().item()), 448.0))
    want = (block * scale).to(torch.float8_e4m3fn).float() * (1.0 / scale)
    assert torch.equal(qt.dequantized[128:, 128:], want)


def test_pow2_spec_covers_every_role_and_hybrid_gives_e5m2_gradients():
    assert all(POW2.cast(r).scale is ScaleFormat.POW2 for r in Role)
    hybrid = Formats(fp8_format="hybrid", fp8_block_scales="pow2").spec("fp8")
    grads = (Role.DGRAD_GRAD_OUTPUT, Role.WGRAD_GRAD_OUTPUT)
    assert all(hybrid.cast(r).element is ElementFormat.E5M2 for r in grads)
    assert all(hybrid.cast(r).element is ElementFormat.E4M3 for r in Role if r not in grads)
    assert hybrid.fprop_weight.block == (128, 128) and hybrid.dgrad_grad_output.block == (1, 128)


def test_e4m3_only_tensorwise():
    e4m3 = Formats(fp8_recipe="tensorwise", fp8_format="e4m3").spec("fp8")
    assert all(e4m3.cast(r).element is ElementFormat.E4M3 and e4m3.cast(r).block is None for r in Role)
    g = torch.randn(16, 48) * 1e3
    q = quantize(g, e4m3.dgrad_grad_output, out_dtype=torch.float32)
    amax = g.abs().amax()
    scale = torch.full_like(amax, 448.0) / amax  # correctly rounded, as TE divides
    assert torch.equal(q, (g * scale).to(torch.float8_e4m3fn).float() * scale.reciprocal())


def test_nvfp4_with_nearest_gradient_rounding_differs_only_in_rounding():
    sr, rn = Formats().spec("fp4"), Formats(fp4_gradient_rounding="nearest").spec("fp4")
    for role in Role:
        a, b = sr.cast(role), rn.cast(role)
        assert b.rounding is Rounding.NEAREST_EVEN
        assert (a.element, a.block, a.scale, a.tensor_scale, a.hadamard) == \
            (b.element, b.block, b.scale, b.tensor_scale, b.hadamard)
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    # No generator needed: nothing is stochastic, and the result equals the forward cast's.
    assert torch.equal(quantize(g, rn.dgrad_grad_output), quantize(g, rn.fprop_input))


def test_defaults_are_unchanged():
    """A variant left unset is the recipe's own: the CPU benchmarks' numerics do not move."""
    for recipe, fmt in (("blockwise", "e4m3"), ("tensorwise", "hybrid"), ("mxfp8", "e4m3")):
        default = Formats(fp8_recipe=recipe)
        assert default.effective_fp8_format == fmt
        assert default.spec("fp8") == Formats(fp8_recipe=recipe, fp8_format=fmt).spec("fp8")
        assert default.spec("fp8") == FormatSpec.for_precision("fp8", fp8_recipe=recipe)
    assert Formats().spec("fp8").fprop_input == CastConfig(element=ElementFormat.E4M3, block=(1, 128))
    tw = Formats(fp8_recipe="tensorwise").spec("fp8")
    assert tw.dgrad_grad_output.element is ElementFormat.E5M2
    assert Formats().spec("fp4").dgrad_grad_output.rounding is Rounding.STOCHASTIC
    assert Formats(fp4_recipe="mxfp4").spec("fp4") == Formats(fp4_recipe="mxfp4",
                                                              fp4_gradient_rounding="nearest").spec("fp4")
    assert Formats().short_str() == "fp8=blockwise fp4=nvfp4"
    assert Formats(fp8_block_scales="pow2").short_str(("bf16", "fp8")) == "fp8=blockwise(pow2)"  # Hopper's TE plan
    assert Formats().short_str(("bf16",)) == "none (BF16 only)"
    assert Formats(fp8_block_scales="pow2", fp4_gradient_rounding="nearest").short_str() == \
        "fp8=blockwise(pow2) fp4=nvfp4(nearest)"


@pytest.mark.parametrize("kwargs, words", [
    (dict(fp8_recipe="mxfp8", fp8_format="hybrid"), "MXFP8 with E5M2 gradients is not emulated"),
    (dict(fp8_recipe="tensorwise", fp8_block_scales="pow2"), "fp8_block_scales='pow2' is the blockwise"),
    (dict(fp8_recipe="mxfp8", fp8_block_scales="pow2"), "E8M0 scales"),
    (dict(fp4_recipe="mxfp4", fp4_gradient_rounding="stochastic"), "MXFP4 rounds to nearest"),
    (dict(fp8_format="e5m2"), r"Formats.fp8_format='e5m2' is not valid; choose one of: e4m3, hybrid"),
    (dict(fp8_block_scales="e8m0"), r"Formats.fp8_block_scales='e8m0' is not valid"),
    (dict(fp4_gradient_rounding="sr"), r"Formats.fp4_gradient_rounding='sr' is not valid"),
])
def test_combinations_we_do_not_emulate_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Formats(**kwargs)
    with pytest.raises(ValueError, match=words.split(" is")[0].replace("Formats.", "")):
        FormatSpec.for_precision("fp8", **kwargs)


def test_pow2_is_an_fp8_block_scale_only():
    with pytest.raises(ValueError, match="pow2 is an FP8 block scale"):
        CastConfig(element=ElementFormat.E2M1, block=(1, 16), scale=ScaleFormat.POW2)
    with pytest.raises(ValueError, match="needs a block shape"):
        CastConfig(element=ElementFormat.E4M3, block=None, scale=ScaleFormat.POW2)
