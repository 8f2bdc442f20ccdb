"""Fake quantization: tensor -> Q(tensor) (dequantized), optionally with its codes and scales.

`quantize` runs the fused path (`formats/fused.py`); `quantize_reference` is the plain eager
implementation it is tested against, bit for bit, and the definition of the numerics below. The
scale formulas are `formats/scales.py`'s, which every path shares (the CPU kernel's C++ restates them).

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

import torch
import torch.nn.functional as F

from snip_megatron.formats.elements import cast_fp8, e2m1_codes, round_e2m1
from snip_megatron.formats.fused import quantize_fused
from snip_megatron.formats.hadamard import hadamard_last_dim
from snip_megatron.formats.quantized import QuantizedTensor
from snip_megatron.formats.scales import (
    block_scales, fp32_encode_scale, nan_where_not_finite, per_tensor_scales, reduce_amax,
)
from snip_megatron.formats.spec import CastConfig, ElementFormat, Role, Rounding
from snip_megatron.formats.sr_noise import CounterNoise, stochastic_noise


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


def _uniform_noise(noise, generator, tensor, dim, pads) -> torch.Tensor:
    noise = stochastic_noise(noise, generator, tensor)
    if isinstance(noise, CounterNoise):
        noise = noise.uniform(tensor.shape, tensor.device)
    u, _ = _gemm_layout(noise.float(), dim)
    pad_r, pad_c = pads
    return F.pad(u, (0, pad_c, 0, pad_r)) if (pad_r or pad_c) else u


def _cast_elements(y, element: ElementFormat, u, want_codes: bool):
    """(values on the element grid as float32, codes or None)."""
    if element is ElementFormat.E2M1:
        q = round_e2m1(y, u)
        return q, (e2m1_codes(q) if want_codes else None)
    codes = cast_fp8(y, element)
    return codes.float(), codes


def _quantize_tensorwise(x, cast, amax_group, want_codes):
    # Current scaling: one FP32 scale from this step's amax of the whole (unsharded) tensor.
    amax = reduce_amax(x.abs().amax(), amax_group)
    scale = fp32_encode_scale(amax, cast.element.max)
    q, codes = _cast_elements(x * scale, cast.element, None, want_codes)
    decode = nan_where_not_finite(scale.reciprocal(), amax)  # TE multiplies by scale_inv = 1/scale
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
    per_tensor = None
    if cast.tensor_scale:  # NVFP4: the E4M3 block scales sit on an FP32 per-tensor scale
        per_tensor = per_tensor_scales(reduce_amax(block_amax.amax(), amax_group), cast, cast.block)
    enc, decode, scales = block_scales(block_amax, cast, per_tensor)
    tensor_scale = None if per_tensor is None else per_tensor[1]
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
    role = Role(role)
    fn = quantize_reference if reference else quantize
    return fn(tensor, spec.cast(role), dim=role.contraction_dim, **kwargs)
