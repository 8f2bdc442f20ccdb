"""A quantized tensor as a tensor-core GEMM reads it: BF16 values that hold every quantized value
exactly, and the FP32 scales BF16 cannot hold, which the GEMM applies to its FP32 result.

Every element format SNIP emulates has at most 4 significant bits (E4M3; E5M2 3, E2M1 2). Times a
power of two (MX's E8M0 scales, blockwise FP8's pow2 scales) or times NVFP4's E4M3 block scale (4
bits), it has at most 8: a BF16 value, exactly. What remains is an FP32 scale: NVFP4's per-tensor
scale and tensorwise FP8's scale (one number: the GEMM multiplies its result, as the hardware
kernels do in their epilogue), and blockwise FP8's FP32 block scales (one per 128-wide block along
the contracted dim: the GEMM runs per K block and scales each partial product, as TE's and
DeepSeek's kernels do). So a BF16 GEMM with FP32 accumulation multiplies exactly the quantized
values, and its result differs from the FP32 GEMM of the dequantized operands only by rounding.

Layout: `values` is (rows, K), the contracted dim last (the layout of `QuantizedTensor.codes`), a
view of the operand's natural layout. A cast with a Hadamard transform stays in the transformed
domain, its K padded to whole blocks: a GEMM over K of two operands under the same orthonormal
transform equals the GEMM of the untransformed ones, and the padding is zeros before it.
Exceptions to "exact": FP32-subnormal products (a block or tensor amax below about 1e-32), which
BF16's shorter subnormal range may round.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from snip_megatron.formats.spec import CastConfig


class GemmOperand(NamedTuple):
    """values x block scale (per block) x tensor scale = the quantized operand (up to one rounding
    of the product); the GEMM reads them in this form (emulation/gemm.py)."""

    values: torch.Tensor
    """(rows, K), BF16, contracted dim last; every element exact (see the module docstring)."""
    tensor_scale: torch.Tensor | None
    """FP32 0-dim decode scale of the whole tensor, for the GEMM's result; None: none."""
    block_scales: torch.Tensor | None
    """FP32 decode scale per `block` of `values`, (ceil(rows / br), ceil(K / bk)); None: none."""
    block: tuple[int, int] | None
    """(br, bk): the block of `block_scales` (and of the cast) in this layout."""

    def t(self) -> "GemmOperand":
        """The same quantized values with rows and K swapped: the operand of the other GEMM that
        reads this quantization (a weight with one scale or square tiles serves fprop and dgrad)."""
        scales = None if self.block_scales is None else self.block_scales.t()
        block = None if self.block is None else (self.block[1], self.block[0])
        return GemmOperand(self.values.t(), self.tensor_scale, scales, block)


@torch.no_grad()
def quantize_operand(tensor: torch.Tensor, cast: CastConfig, *, dim: int = -1,
                     noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
                     amax_group=None) -> GemmOperand:
    """Q(tensor) under `cast` as a GEMM operand (arguments as `quantize`); `tensor` is viewed as 2D
    (leading dims, last dim) and `dim` (0 or -1) is the contracted one. The same casts, scales and
    random bits as `quantize`: only the scales FP32 needs are kept apart."""
    from snip_megatron.formats.fused import quantize_fused
    from snip_megatron.formats.quantize import _check

    if cast is None:
        raise ValueError("quantize_operand needs a CastConfig (an unquantized operand is the tensor itself)")
    _check(tensor, cast, None, False)
    values, tensor_scale, block_scales, block = quantize_fused(
        tensor, cast, dim=dim, noise=noise, generator=generator, amax_group=amax_group, operand=True)
    return GemmOperand(values, tensor_scale, block_scales, None if block_scales is None else block)
