"""Fake quantization: tensor -> Q(tensor) (dequantized), optionally with its codes and scales.

`quantize` runs the fused path (`formats/fused.py`); `quantize_reference` is the plain eager
implementation it is tested against, bit for bit, and the definition of the numerics below.

Numerics follow the hardware recipes and, where torchao has a reference, match it bit for bit:
NVFP4 = torchao `nvfp4_quantize(x, 16, per_tensor_amax_to_scale(amax))` then dequantize;
MX = torchao `to_mx(x, dtype, 32, RCEIL)` then dequantize. FP8 element casts are torch's float8
casts after saturation.

Rules (documented behaviour, tested):
- Layout: the tensor is viewed as 2D, (all leading dims, last dim). `dim=-1` runs the blocks along
  the last dim; `dim=0` along the flattened leading dims (the token dim of a [s, b, h] activation).
- Shapes that are not a multiple of the block are zero-padded to the next multiple, quantized and
  cropped: zeros do not change any amax, so a partial block is quantized as if zero-filled.
- NaN/Inf never silently become finite: every element of a scaling group (its block; for
  per-tensor scales the whole tensor, including other TP shards) that holds a NaN or +-Inf
  dequantizes to NaN.
- All-zero blocks and tensors dequantize to zero. NVFP4 block scales below E4M3's smallest normal
  (2**-6) are raised to it, as torchao does (TE would keep subnormal scales; this only differs for
  blocks whose amax is below ~3.5e-5 of the tensor's).
- FP32 block scales are max / amax (1 for an all-zero block, capped at the largest float32), as
  TE's compute_scale_from_amax; pow2 scales are that with the mantissa bits cleared (its
  force_pow_2_scales), so the decode scale 1 / scale is exact.
- Per-tensor amaxes (NVFP4 global scale, tensorwise FP8) are all-reduced (MAX) over `amax_group`,
  so a sharded tensor gets the scale of the whole tensor, as Transformer Engine does.
- Stochastic rounding (E2M1) is floor(|y| / step + u) * step with u in [0, 1) on torch.rand's
  24-bit grid; u comes from the counter-based generator of formats/sr_noise.py (seeded by one
  draw from `generator`), or from an explicit `noise` tensor.
- The Hadamard transform (formats/hadamard.py) runs in a fixed float32 operation order, the same
  in the reference, the eager path and the CPU kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from snip_megatron.formats.constants import (
    E4M3_MAX, E4M3_MIN_NORMAL, E8M0_BIAS, E8M0_NAN_CODE, F32_MAX, F32_MIN_NORMAL,
    NVFP4_GLOBAL_DIVISOR,
)
from snip_megatron.formats.elements import cast_fp8, e2m1_codes, e8m0_round_up, round_e2m1
from snip_megatron.formats.hadamard import hadamard_last_dim
from snip_megatron.formats.spec import CastConfig, ElementFormat, Rounding, ScaleFormat
from snip_megatron.formats.sr_noise import CounterNoise, draw_seed


class QuantizedTensor(NamedTuple):
    """Q(t) and how it is stored. codes/scales are in the GEMM layout (blocked dim last), padded to
    whole blocks and, with a Hadamard transform, in the transformed domain."""

    dequantized: torch.Tensor
    """Q(t) in t's layout and shape (Hadamard undone), dtype out_dtype."""
    codes: torch.Tensor
    """float8 tensor (FP8 elements) or uint8 E2M1 codes (bit 3 = sign)."""
    scales: torch.Tensor
    """Decode scale per block, (rows // br, cols // bc): float32 (powers of two for pow2 scales),
    float8_e4m3fn (NVFP4) or uint8 biased E8M0 exponents (255 = NaN); a 1x1 float32 tensor for
    per-tensor scaling."""
    tensor_scale: torch.Tensor | None
    """NVFP4 FP32 per-tensor decode scale (amax / 2688); None otherwise."""


def quantize(tensor: torch.Tensor, cast: CastConfig | None, *, dim: int = -1,
             out_dtype: torch.dtype | None = None, generator: torch.Generator | None = None,
             noise: torch.Tensor | None = None, amax_group=None,
             return_codes: bool = False) -> "torch.Tensor | QuantizedTensor":
    """Q(tensor) under `cast` (None: no quantization, the tensor itself).

    dim: 0 or -1, the dimension the blocks run along (the GEMM's contraction dim).
    out_dtype: dtype of the dequantized result (default: tensor's dtype; use float32 to keep Q(t)
        exactly).
    generator / noise: random bits for stochastic rounding; `noise` wins: a U[0,1) tensor of
        tensor's shape, or a `CounterNoise` (formats/sr_noise.py); a generator seeds a
        CounterNoise with one draw.
    amax_group: process group over which the per-tensor amax is all-reduced (tensor parallelism).
    return_codes: return a QuantizedTensor instead of the dequantized tensor.

    The result equals `quantize_reference(...)` bit for bit (the fused path, `formats/fused.py`).
    A dim-0 result may be a transposed view.
    """
    early = _check(tensor, cast, out_dtype, return_codes)
    if early is not None:
        return early
    from snip_megatron.formats.fused import quantize_fused

    return quantize_fused(tensor, cast, dim=dim, out_dtype=out_dtype, noise=noise,
                          generator=generator, amax_group=amax_group, return_codes=return_codes)


def _check(tensor, cast, out_dtype, return_codes):
    """The argument checks of both paths; the result itself when there is nothing to quantize."""
    if cast is None:
        if return_codes:
            raise ValueError("return_codes=True needs a CastConfig (cast=None means no quantization)")
        return tensor.to(tensor.dtype if out_dtype is None else out_dtype)
    if not tensor.is_floating_point():
        raise ValueError(f"quantize needs a floating-point tensor, got {tensor.dtype}")
    if tensor.dim() < 1 or tensor.numel() == 0:
        raise ValueError(f"quantize needs a non-empty tensor, got shape {tuple(tensor.shape)}")
    return None


@torch.no_grad()
def quantize_reference(tensor: torch.Tensor, cast: CastConfig | None, *, dim: int = -1,
                       out_dtype: torch.dtype | None = None, generator: torch.Generator | None = None,
                       noise: torch.Tensor | None = None, amax_group=None,
                       return_codes: bool = False) -> "torch.Tensor | QuantizedTensor":
    """The eager reference of `quantize` (same arguments): one whole-tensor step at a time, as
    the rules above state it. Tests hold the fused path to it."""
    early = _check(tensor, cast, out_dtype, return_codes)
    if early is not None:
        return early
    out_dtype = tensor.dtype if out_dtype is None else out_dtype
    x, transposed = _gemm_layout(tensor.float(), dim)
    rows, cols = x.shape
    br, bc = cast.block if cast.block is not None else (1, 1)
    pad_r, pad_c = -rows % br, -cols % bc
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    if cast.hadamard:
        x = hadamard_last_dim(x, cast.hadamard)
    u = None
    if cast.rounding is Rounding.STOCHASTIC:
        u = _uniform_noise(noise, generator, tensor, dim, (pad_r, pad_c))

    if cast.block is None:
        q, codes, scales, tensor_scale = _quantize_tensorwise(x, cast, amax_group, return_codes)
    else:
        q, codes, scales, tensor_scale = _quantize_blocked(x, cast, amax_group, u, return_codes)

    deq = q
    if cast.hadamard:
        deq = hadamard_last_dim(deq, cast.hadamard, inverse=True)
    deq = deq[:rows, :cols]
    if transposed:
        deq = deq.t()
    deq = deq.reshape(tensor.shape).to(out_dtype)
    if not return_codes:
        return deq
    return QuantizedTensor(deq, codes, scales, tensor_scale)


def _gemm_layout(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, bool]:
    """2D float32 view with the blocked dim last, and whether it was transposed."""
    if dim not in (0, -1, x.dim() - 1):
        raise ValueError(f"quantize: dim must be 0 or -1 (the blocked dimension), got {dim}")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 1 else x.reshape(1, -1)
    if dim == 0 and x.dim() > 1:
        return x2.t().contiguous(), True
    return x2.contiguous(), False


def stochastic_noise(noise, generator, tensor):
    """The noise of a stochastic cast of `tensor`: a U[0, 1) tensor of its shape (`noise` given
    as one), or a `CounterNoise` (given, or seeded from `generator`: one draw, so each cast gets
    its own stream; formats/sr_noise.py)."""
    if noise is None:
        if generator is None:
            raise ValueError("stochastic rounding needs generator= or noise=")
        return CounterNoise(draw_seed(generator))
    if isinstance(noise, CounterNoise):
        return noise
    if noise.shape != tensor.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != tensor shape {tuple(tensor.shape)}")
    return noise


def _uniform_noise(noise, generator, tensor, dim, pads) -> torch.Tensor:
    noise = stochastic_noise(noise, generator, tensor)
    if isinstance(noise, CounterNoise):
        noise = noise.uniform(tensor.shape, tensor.device)
    u, _ = _gemm_layout(noise.float(), dim)
    pad_r, pad_c = pads
    return F.pad(u, (0, pad_c, 0, pad_r)) if (pad_r or pad_c) else u


def _reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    # NaN -> Inf first: MAX reductions need not propagate NaN, Inf they do; both mean "non-finite".
    amax = torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def _cast_elements(y, element: ElementFormat, u, want_codes: bool):
    """(values on the element grid as float32, codes or None)."""
    if element is ElementFormat.E2M1:
        q = round_e2m1(y, u)
        return q, (e2m1_codes(q) if want_codes else None)
    codes = cast_fp8(y, element)
    return codes.float(), codes


def _fp32_encode_scale(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    # max / amax, 1 for all-zero groups, capped at the largest float32 (TE's compute_scale).
    # Divided as TE divides (TE v2.14 recipe/recipe_common.cuh:28-31, __fdiv_rn(max_fp8, amax)): a
    # tensor over a tensor. `elem_max / amax` would be amax.reciprocal() * elem_max (PyTorch's
    # Tensor.__rtruediv__), an ulp off TE's scale for about a third of the amaxes.
    scale = torch.full_like(amax, elem_max) / amax
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return scale.clamp(max=F32_MAX)


def _round_down_to_pow2(scale: torch.Tensor) -> torch.Tensor:
    # TE's force_pow_2_scales: keep the sign and exponent bits of the float32 scale, clear the
    # mantissa (0xFF800000 as int32). Scales here are positive normal floats (or 0 for non-finite
    # amaxes, which stay 0 and dequantize to NaN).
    return (scale.contiguous().view(torch.int32) & -(1 << 23)).view(torch.float32)


def _nan_where_not_finite(decode: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(amax), decode, torch.full_like(decode, float("nan")))


def _quantize_tensorwise(x, cast, amax_group, want_codes):
    # Current scaling: one FP32 scale from this step's amax of the whole (unsharded) tensor.
    amax = _reduce_amax(x.abs().amax(), amax_group)
    scale = _fp32_encode_scale(amax, cast.element.max)
    q, codes = _cast_elements(x * scale, cast.element, None, want_codes)
    decode = _nan_where_not_finite(scale.reciprocal(), amax)  # TE multiplies by scale_inv = 1/scale
    return q.mul_(decode), codes, decode.reshape(1, 1), None


def _quantize_blocked(x, cast, amax_group, u, want_codes):
    rows, cols = x.shape
    br, bc = cast.block
    nr, nc = rows // br, cols // bc
    xb = x.view(nr, br, nc, bc)
    if br == 1:
        lo, hi = torch.aminmax(xb, dim=-1, keepdim=True)  # one pass, no |x| temporary
        block_amax = torch.maximum(hi, lo.neg())  # (nr, 1, nc, 1); NaN propagates
    else:
        block_amax = xb.abs().amax(dim=(1, 3), keepdim=True)
    elem_max = cast.element.max
    tensor_scale = None

    if cast.scale in (ScaleFormat.FP32, ScaleFormat.POW2):
        enc = _fp32_encode_scale(block_amax, elem_max)
        if cast.scale is ScaleFormat.POW2:
            enc = _round_down_to_pow2(enc)
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
    else:  # NVFP4: E4M3 block scale on an FP32 per-tensor scale
        amax = _reduce_amax(block_amax.amax(), amax_group)
        global_scale = amax / NVFP4_GLOBAL_DIVISOR
        # All-zero (or absurdly tiny, amax < ~3e-35) tensors: any finite scale quantizes them to 0.
        global_scale = torch.where(global_scale >= F32_MIN_NORMAL, global_scale,
                                   torch.ones_like(global_scale))
        block_scale = (block_amax / elem_max) / global_scale
        block_scale_e4m3 = block_scale.clamp(E4M3_MIN_NORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
        block_scale_f32 = block_scale_e4m3.float()
        # Same operation order as torchao (and TE's kernel): x * ((1 / global) / block), and
        # dequantize with (global * block).
        enc = (1.0 / global_scale) / block_scale_f32
        decode = _nan_where_not_finite(global_scale * block_scale_f32, amax)
        scales, tensor_scale = block_scale_e4m3, global_scale

    decode = _nan_where_not_finite(decode, block_amax)
    ub = None if u is None else u.view(nr, br, nc, bc)
    q, codes = _cast_elements(xb * enc, cast.element, ub, want_codes)
    deq = q.mul_(decode).view(rows, cols)
    codes = None if codes is None else codes.view(rows, cols)
    return deq, codes, scales.reshape(nr, nc), tensor_scale


def quantize_for_role(tensor: torch.Tensor, spec, role, *, reference: bool = False,
                      **kwargs) -> "torch.Tensor | QuantizedTensor":
    """quantize() with the role's cast and blocking dim: `tensor` is the role's operand in its
    natural layout (X: [..., k] tokens x in-features, W: m x k, G_Y: [..., m]); kwargs as quantize.
    reference=True runs `quantize_reference`."""
    from snip_megatron.formats.spec import Role

    role = Role(role)
    fn = quantize_reference if reference else quantize
    return fn(tensor, spec.cast(role), dim=role.contraction_dim, **kwargs)
