"""Numeric constants of the element and scale formats (values in comments are exact)."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
E4M3_MIN_NORMAL = 2.0**-6  # 0.015625, torch.finfo(torch.float8_e4m3fn).tiny
E5M2_MAX = 57344.0  # torch.finfo(torch.float8_e5m2).max
E2M1_MAX = 6.0  # largest FP4 value
# The eight E2M1 magnitudes, indexed by the 3-bit code (bit 3 of a code is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

E8M0_BIAS = 127  # E8M0 code e means 2**(e - 127)
E8M0_MAX_CODE = 254  # 2**127; code 255 is NaN
E8M0_NAN_CODE = 255

F32_MAX = torch.finfo(torch.float32).max  # 3.4028e38
F32_MIN_NORMAL = torch.finfo(torch.float32).tiny  # 2**-126

# NVFP4 second-level scale: global = amax / (E4M3_MAX * E2M1_MAX) lets the largest block scale use
# the whole E4M3 range.
NVFP4_GLOBAL_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688.0

# The random sign vector of the 16-point Hadamard transform: Transformer Engine's hard-coded one
# (TE v2.14 pytorch/tensor/nvfp4_tensor.py:49-60 `get_wgrad_sign_vector`, the same in
# custom_recipes/quantization_nvfp4.py:334-339 and at TE 2.18), so that SNIP's NVFP4 wgrad
# operands are the ones TE's kernels quantize. It must be the same on every rank and in every run
# so both wgrad operands see the same transform.
HADAMARD_SIGNS_16 = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
# Other sizes (TE has none): a random sign vector from this fixed seed.
HADAMARD_SIGN_SEED = 0x5EED
