"""Bit-exact agreement with torchao's pure-PyTorch reference quantizers (CPU), of the fused
quantizer and of the eager reference it is tested against."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from snip_megatron.formats import FormatSpec, quantize, quantize_reference

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.kernels import unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale,
    )

NVFP4_1x16 = FormatSpec.for_precision("fp4").fprop_input
MXFP4 = FormatSpec.for_precision("fp4", fp4_recipe="mxfp4").fprop_input
MXFP8 = FormatSpec.for_precision("fp8", fp8_recipe="mxfp8").fprop_input


def _magnitudes(rows=64, cols=256, lo=-30, hi=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    exps = torch.empty(rows, 1).uniform_(lo, hi, generator=g)
    return torch.randn(rows, cols, generator=g) * 10.0 ** exps


def _ties():
    # Global scale 1 (tensor amax 2688 = 448 * 6) and block scale 1 (block amax 6): the scaled
    # values are exactly the E2M1 rounding ties.
    # Rows are 32 wide: two NVFP4 blocks, one MX block (MX block amax 6 -> scale 2**0 too).
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    row = torch.cat([ties, -ties, -ties, ties])
    # E4M3 ties at scale 1 (MXFP8 block amax 448): normal and subnormal midpoints.
    fp8_ties = torch.tensor([448.0, 1.0625, 1.1875, 17.0, 19.0, 0.0029296875, 0.0009765625, -2.0**-10])
    fp8_row = torch.cat([fp8_ties, -fp8_ties, fp8_ties * 0.5, fp8_ties.flip(0)])
    return torch.stack([row, row.flip(0), torch.full((32,), 2688.0), fp8_row])


def _outlier():
    x = torch.randn(8, 64) * 1e-2
    x[3, 5] = 1e4
    x[6, 40] = -3e5
    return x


def _zero_blocks():
    x = torch.randn(8, 64)
    x[2] = 0
    x[5, 16:32] = 0
    return x


def _subnormal_scales():
    # Blocks far below the tensor amax: NVFP4 block scales under E4M3's smallest normal; MX scales
    # at the bottom of E8M0 and fp32-subnormal inputs.
    x = torch.randn(6, 64)
    x[0] *= 1e4
    x[1] *= 1e-6
    x[2] *= 1e-38
    x[3] = torch.randn(64) * 1e-42  # fp32 subnormal values
    x[4, :32] = 2.0**-130
    return x


CASES = {
    "magnitudes": _magnitudes(),
    "ties": _ties(),
    "outlier": _outlier(),
    "zero_blocks": _zero_blocks(),
    "subnormal_scales": _subnormal_scales(),
    "bf16": _magnitudes(lo=-8, hi=8, seed=1).bfloat16(),
}


PATHS = pytest.mark.parametrize("quantize", [quantize, quantize_reference], ids=["fused", "reference"])


@PATHS
@pytest.mark.parametrize("name", list(CASES))
def test_nvfp4_matches_torchao(name, quantize):
    x = CASES[name]
    ours = quantize(x, NVFP4_1x16, return_codes=True, out_dtype=torch.float32)
    pts = per_tensor_amax_to_scale(x.float().abs().amax())
    scales, packed = nvfp4_quantize(x, 16, pts)
    assert torch.equal(ours.scales.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(ours.codes, unpack_uint4(packed))
    assert torch.equal(ours.tensor_scale, pts)
    ref = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts).dequantize(torch.float32)
    assert torch.equal(ours.dequantized, ref)


@pytest.mark.parametrize("cast,elem", [(MXFP4, torch.float4_e2m1fn_x2), (MXFP8, torch.float8_e4m3fn)],
                         ids=["mxfp4", "mxfp8"])
@PATHS
@pytest.mark.parametrize("name", list(CASES))
def test_mx_matches_torchao_rceil(name, cast, elem, quantize):
    x = CASES[name]
    ours = quantize(x, cast, return_codes=True, out_dtype=torch.float32)
    exp, data = to_mx(x, elem, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(ours.scales, exp.view(torch.uint8).reshape(ours.scales.shape))
    if elem == torch.float8_e4m3fn:
        assert torch.equal(ours.codes.view(torch.uint8), data.view(torch.uint8))
    else:
        assert torch.equal(ours.codes, unpack_uint4(data))
    ref = to_dtype(data, exp, elem, 32, torch.float32)
    assert torch.equal(ours.dequantized, ref)


@PATHS
@pytest.mark.parametrize("shape", [(7, 50), (3, 5), (33, 17)])
def test_non_multiple_shapes_pad_with_zeros(shape, quantize):
    # Policy: zero-pad to whole blocks, quantize, crop. torchao rejects such shapes, so compare with
    # torchao on the zero-padded tensor.
    x = _magnitudes(*shape, lo=-3, hi=3, seed=2)
    ours = quantize(x, NVFP4_1x16, out_dtype=torch.float32)
    xp = F.pad(x, (0, -shape[1] % 16))
    pts = per_tensor_amax_to_scale(x.abs().amax())
    ref = NVFP4Tensor.to_nvfp4(xp, per_tensor_scale=pts).dequantize(torch.float32)[:, : shape[1]]
    assert torch.equal(ours, ref)
    xp32 = F.pad(x, (0, -shape[1] % 32))
    exp, data = to_mx(xp32, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL)
    ref = to_dtype(data, exp, torch.float4_e2m1fn_x2, 32, torch.float32)[:, : shape[1]]
    assert torch.equal(quantize(x, MXFP4, out_dtype=torch.float32), ref)


@PATHS
def test_rceil_where_torchao_log2_rounds_down(quantize):
    # descale = amax / 6 a hair above 2**4: exact RCEIL (hardware cvt.rp) gives 2**5; torchao's
    # eager ceil(log2()) rounds to 4 and then saturates the block maximum. We follow the hardware.
    descale = torch.tensor(16.0) * (1 + 2.0**-23)
    x = torch.zeros(1, 32)
    x[0, 0] = descale * 6
    x[0, 1] = 1.0
    ours = quantize(x, MXFP4, return_codes=True, out_dtype=torch.float32)
    x[0, 1] = 24.0
    ours = quantize(x, MXFP4, return_codes=True, out_dtype=torch.float32)
    assert int(ours.scales) == 127 + 5  # 2**5 >= descale
    assert ours.dequantized[0, 0] == 96.0  # 3.0000002 * 32 rounds to 3 * 32
    assert ours.dequantized[0, 1] == 32.0  # 24 / 32 = 0.75, a tie, rounds to even (1.0)
    exp, _ = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL)
    assert int(exp.view(torch.uint8)) == 127 + 4  # torchao's eager fallback: one less
