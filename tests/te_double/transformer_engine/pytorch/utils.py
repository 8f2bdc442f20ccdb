"""Test double of `transformer_engine.pytorch.utils` (TE 2.14): the GPU's compute capability.

The double has no GPU: its capability is TE_DOUBLE_COMPUTE_CAPABILITY ("9.0" = H100, "10.0" =
B200; default "10.0"), read on every call so a test can change it between checks. The recipe
support checks (`pytorch/quantization.py`) and the kernel checks the double models (NVFP4 needs
SM100+, blockwise FP8 on SM100+ needs power-of-two scales) read it here.
"""

from __future__ import annotations

import os
from typing import Tuple

CAPABILITY_VARIABLE = "TE_DOUBLE_COMPUTE_CAPABILITY"


def get_device_compute_capability() -> Tuple[int, int]:
    """(major, minor) of the GPU the double stands in for."""
    text = os.environ.get(CAPABILITY_VARIABLE, "10.0")
    try:
        major, minor = (int(part) for part in text.split("."))
    except ValueError:
        raise ValueError(f"{CAPABILITY_VARIABLE}={text!r} must read like 9.0 or 10.0") from None
    return major, minor
