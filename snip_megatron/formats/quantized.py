"""The result of a cast with its codes: `QuantizedTensor` (quantize(..., return_codes=True))."""

from __future__ import annotations

from typing import NamedTuple

import torch


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
