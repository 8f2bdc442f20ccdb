"""The scales of a cast: per-tensor amax reduction, encode / decode scales, NaN poisoning.

One definition for every path: the reference (quantize.py) and the fused, kernel and compiled
paths (fused.py, kernel_path.py, compiled.py) all read their scale arithmetic from here, so the
formulas below are the ones the rules of quantize.py state, written once.
"""

from __future__ import annotations

import torch

from snip_megatron.formats.constants import (
    E4M3_MAX, E4M3_MIN_NORMAL, E8M0_BIAS, E8M0_NAN_CODE, F32_MAX, F32_MIN_NORMAL, NVFP4_GLOBAL_DIVISOR,
)
from snip_megatron.formats.elements import e8m0_round_up
from snip_megatron.formats.spec import CastConfig, ScaleFormat


def group_size(group) -> int:
    return torch.distributed.get_world_size(group)


def reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """The amax all-reduced (MAX) over `group` (None or one rank: as it is), NaN as Inf."""
    # NaN -> Inf first: MAX reductions need not propagate NaN, Inf they do; both mean "non-finite".
    amax = torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)
    if group is not None and group_size(group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def fp32_encode_scale(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    # max / amax, 1 for all-zero groups, capped at the largest float32 (TE's compute_scale).
    # Divided as TE divides (TE v2.14 recipe/recipe_common.cuh:28-31, __fdiv_rn(max_fp8, amax)): a
    # tensor over a tensor. `elem_max / amax` would be amax.reciprocal() * elem_max (PyTorch's
    # Tensor.__rtruediv__), an ulp off TE's scale for about a third of the amaxes.
    scale = torch.full_like(amax, elem_max) / amax
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return scale.clamp(max=F32_MAX)


def round_down_to_pow2(scale: torch.Tensor) -> torch.Tensor:
    # TE's force_pow_2_scales: keep the sign and exponent bits of the float32 scale, clear the
    # mantissa (0xFF800000 as int32). Scales here are positive normal floats (or 0 for non-finite
    # amaxes, which stay 0 and dequantize to NaN).
    return (scale.contiguous().view(torch.int32) & -(1 << 23)).view(torch.float32)


def nan_where_not_finite(decode: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(amax), decode, torch.full_like(decode, float("nan")))


def per_tensor_scales(amax, cast: CastConfig, block):
    """The per-tensor scales from the tensor's amax: tensorwise (block None): (encode, decode),
    1x1; NVFP4's second level: (amax, global scale, its reciprocal)."""
    if block is None:
        enc = fp32_encode_scale(amax, cast.element.max)
        decode = nan_where_not_finite(enc.reciprocal(), amax)  # TE multiplies by 1 / scale
        # 1x1, not 0-dim: a 0-dim float32 would not promote a bfloat16 chunk to float32.
        return enc.view(1, 1), decode.view(1, 1)
    global_scale = amax / NVFP4_GLOBAL_DIVISOR
    # All-zero (or absurdly tiny, amax < ~3e-35) tensors: any finite scale quantizes them to 0.
    global_scale = torch.where(global_scale >= F32_MIN_NORMAL, global_scale,
                               torch.ones_like(global_scale))
    return amax, global_scale, 1.0 / global_scale


def block_scales(block_amax, cast: CastConfig, per_tensor):
    """(encode, decode poisoned where the block or tensor is not finite, scales) of the block
    amaxes (any shape: the scales take it); `per_tensor`: NVFP4's `per_tensor_scales`. NVFP4's
    block scales below E4M3's smallest normal are raised to it, as torchao does."""
    elem_max = cast.element.max
    if cast.scale in (ScaleFormat.FP32, ScaleFormat.POW2):
        enc = fp32_encode_scale(block_amax, elem_max)
        if cast.scale is ScaleFormat.POW2:
            enc = round_down_to_pow2(enc)
        decode = enc.reciprocal()  # exact for a power of two
        scales = decode
    elif cast.scale is ScaleFormat.E8M0:
        # RCEIL: the smallest power of two with amax / scale <= max, so nothing saturates.
        exp = e8m0_round_up(block_amax / elem_max)
        # Reciprocal as TE's exp2f_rcp: code 0 (2**-127) encodes with 1.0.
        enc = torch.where(exp == 0, torch.ones_like(block_amax),
                          torch.exp2((E8M0_BIAS - exp).to(torch.float32)))
        decode = torch.exp2((exp - E8M0_BIAS).to(torch.float32))
        scales = torch.where(torch.isfinite(block_amax), exp, torch.full_like(exp, E8M0_NAN_CODE))
        scales = scales.to(torch.uint8)
    else:  # NVFP4: E4M3 block scale on the FP32 per-tensor scale
        amax, global_scale, inv_global = per_tensor
        block_scale = (block_amax / elem_max) / global_scale
        scales = block_scale.clamp(E4M3_MIN_NORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
        block_scale_f32 = scales.float()
        # Same operation order as torchao (and TE's kernel): x * ((1 / global) / block), and
        # dequantize with (global * block).
        enc = inv_global / block_scale_f32
        decode = nan_where_not_finite(global_scale * block_scale_f32, amax)
    return enc, nan_where_not_finite(decode, block_amax), scales
