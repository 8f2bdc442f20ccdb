"""What a test process needs to hold SNIP's emulation to the TE double (tests/te_double), which
computes TE's quantizers and GEMMs itself and imports nothing from snip_megatron.

- `share_snip_noise()`: TE's stochastic-rounding bits come from a Philox stream on the GPU, which
  neither side reproduces; a process that compares the two installs SNIP's draws (one seed per
  quantized copy from the module's `sr_generator`, formats/sr_noise.py) as the double's source,
  so that the rounding rule and where it applies are compared bit for bit.
- `agree(got, want, recipe)`: the double and SNIP agree bit for bit on blockwise, tensorwise and
  MXFP8 GEMMs (the same dequantized FP32 operands, multiplied alike). For NVFP4 TE's arithmetic
  order differs from SNIP's, so their FP32 results differ by a few ulps of the largest value:
  the double dequantizes as TE's kernel does, elements * (s_dec_b * amax * (1/2688))
  (TE v2.14 cast/nvfp4/dequantize_nvfp4.cuh:59-67) where SNIP takes elements * (global * s_dec_b),
  and its wgrad GEMM multiplies in the Hadamard domain, as TE's does, where SNIP transforms each
  operand back first. A different format (another tile, scale rounding or Hadamard sign) moves the
  results by 1e-3 to 1e-1 of their largest value; NVFP4_TOL sits between the two.
"""

from __future__ import annotations

import torch

NVFP4_TOL = 1e-5
"""NVFP4 results agree when max|got - want| <= NVFP4_TOL * max|want|, per tensor (measured: up to
5e-7 on the tests' shapes)."""


def share_snip_noise() -> None:
    """Give the double (already on sys.path) SNIP's stochastic-rounding draws."""
    from transformer_engine.pytorch.module._quantize import set_stochastic_noise

    from snip_megatron.formats.sr_noise import CounterNoise, draw_seed

    set_stochastic_noise(lambda generator, shape: CounterNoise(draw_seed(generator)).uniform(shape))


def close(a: torch.Tensor, b: torch.Tensor, tol: float = NVFP4_TOL) -> bool:
    """max|a - b| <= tol * max|b| (same shapes; NaN never agrees)."""
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool((a.float() - b.float()).abs().max() <= tol * b.float().abs().max())


def agree(got, want, recipe: "str | None") -> bool:
    """Each pair of tensors of `got` and `want` (or one pair) is bit-identical, or for `recipe`
    "nvfp4" within NVFP4_TOL (module docstring)."""
    if isinstance(got, torch.Tensor):
        got, want = (got,), (want,)
    if len(got) != len(want):
        return False
    if recipe == "nvfp4":
        return all(close(a, b) for a, b in zip(got, want))
    return all(torch.equal(a, b) for a, b in zip(got, want))
