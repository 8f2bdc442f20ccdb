"""Element casts: float32 (already scaled) -> the values of an element format, and E8M0 scales.

Pure functions on float32 tensors; all work on CPU and CUDA in eager mode.
"""

from __future__ import annotations

import torch

from snip_megatron.formats.constants import E2M1_MAX, E4M3_MAX, E5M2_MAX, E8M0_MAX_CODE
from snip_megatron.formats.spec import ElementFormat

_FP8_DTYPES = {ElementFormat.E4M3: torch.float8_e4m3fn, ElementFormat.E5M2: torch.float8_e5m2}

# Round-to-nearest-even to an element grid by adding and subtracting a magic power of two: for
# |y| in [2**e, 2**(e+1)) with e at least the format's smallest normal exponent emin, adding
# 2**(e + 23 - mantissa_bits) leaves a float32 whose last bit is worth one grid step, so the
# IEEE addition rounds |y| to the grid, ties to even, and the subtraction is exact. Below 2**emin
# the grid step is the subnormal step, the one of e = emin. (The fused and compiled paths.)
GRID = {
    # element: (largest magnitude, float32 bits of 2**emin, (23 - mantissa bits) << 23)
    ElementFormat.E2M1: (E2M1_MAX, 127 << 23, 22 << 23),  # emin 0, 1 mantissa bit
    ElementFormat.E4M3: (E4M3_MAX, (127 - 6) << 23, 20 << 23),  # emin -6, 3 mantissa bits
    ElementFormat.E5M2: (E5M2_MAX, (127 - 14) << 23, 21 << 23),  # emin -14, 2 mantissa bits
}


def fp8_dtype(element: ElementFormat) -> torch.dtype:
    return _FP8_DTYPES[element]


@torch.no_grad()
def cast_fp8(y: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    """Saturating round-to-nearest-even cast to E4M3/E5M2; returns the float8 codes.

    torch's eager cast does not saturate (finite overflow -> NaN for e4m3fn, inf for e5m2), so
    clamp first; NaN passes through the clamp and stays NaN.
    """
    m = element.max
    return y.clamp(-m, m).to(_FP8_DTYPES[element])


@torch.no_grad()
def round_e2m1(y: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Saturating cast to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (with sign), as float32 values.

    noise=None: round to nearest, ties to even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4).
    noise=u ~ U[0, 1) of y's shape: stochastic rounding, floor(|y| / step + u) * step, unbiased
    for |y| <= 6 (values beyond 6 saturate first).
    """
    a = y.abs().clamp_(max=E2M1_MAX)  # NaN stays NaN
    # The grid step is 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]: half the power of two at or below
    # max(|y|, 1). Read it from the float32 exponent bits (integer ops: fewer passes than floats).
    exp_bits = (a.view(torch.int32) & 0x7F800000).clamp_(min=0x3F800000)  # 1.0's exponent at least
    if noise is None:
        # Adding 2**22 * pow2 leaves a float32 whose last mantissa bit is worth exactly one step, so
        # IEEE addition performs the round-to-nearest-even; subtracting it back is exact.
        magic = exp_bits.add_(22 << 23).view(torch.float32)  # exponent + 22: times 2**22
        a.add_(magic).sub_(magic)
    else:
        step = exp_bits.sub_(1 << 23).view(torch.float32)  # exponent - 1: half the power of two
        a.div_(step).add_(noise).floor_().mul_(step)  # div and mul by a power of two are exact
        # 3 + u can round up to 4 in float32 when u > 1 - 2**-23; keep 6 the largest value.
        a.clamp_(max=E2M1_MAX)
    return a.copysign_(y)


@torch.no_grad()
def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, bit 3 = sign, bits 0-2 index into E2M1_VALUES) of grid values q."""
    a = q.abs()
    idx = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a * 0.5 + 4))
    return idx.to(torch.uint8) | (torch.signbit(q).to(torch.uint8) << 3)


@torch.no_grad()
def e8m0_round_up(descale: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent (int32, 0..254) of the smallest power of two >= descale >= 0 (RCEIL,
    as cvt.rp.satfinite.ue8m0 and TE do); exponents clamp to [-127, 127].

    Exact from the float32 bits. (torchao's eager fallback uses ceil(log2(x)), whose rounding gives
    one exponent less when x is a hair above a power of two; the hardware rounds up.)
    """
    bits = descale.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    normal = exp + (mant != 0).to(torch.int32)
    # Subnormal descale = mant * 2**-149: above 2**-127 it rounds up to 2**-126 (code 1), else code 0.
    subnormal = (mant > (1 << 22)).to(torch.int32)
    return torch.where(exp == 0, subnormal, normal).clamp_(max=E8M0_MAX_CODE)
