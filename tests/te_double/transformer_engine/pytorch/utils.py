"""Test double of `transformer_engine.pytorch.utils` (TE 2.14): the GPU and CUDA the double stands in
for, and TE's FP8 shape assert.

The double has no GPU. Three environment variables stand in for what TE asks CUDA, each read on
every call (TE caches the checks built on them, `functools.lru_cache` in quantization.py; the
double does not, so a test can change them between checks):

    TE_DOUBLE_COMPUTE_CAPABILITY  torch.cuda.get_device_capability(): "9.0" = H100, "10.0" = B200
                                  (default "10.0")
    TE_DOUBLE_CUDA_VERSION        torch.version.cuda, e.g. "12.8" (default "13.0")
    TE_DOUBLE_CUBLASLT_VERSION    tex.get_cublasLt_version(), e.g. 120103 for 12.1.3 (default: the
                                  CUDA version's, major * 10000 + minor * 100)
"""

from __future__ import annotations

import math
import os
from typing import Tuple

import torch

CAPABILITY_VARIABLE = "TE_DOUBLE_COMPUTE_CAPABILITY"
CUDA_VERSION_VARIABLE = "TE_DOUBLE_CUDA_VERSION"
CUBLASLT_VERSION_VARIABLE = "TE_DOUBLE_CUBLASLT_VERSION"
DEFAULT_CUDA_VERSION = "13.0"


def get_device_compute_capability() -> Tuple[int, int]:
    """(major, minor) of the GPU the double stands in for."""
    text = os.environ.get(CAPABILITY_VARIABLE, "10.0")
    try:
        major, minor = (int(part) for part in text.split("."))
    except ValueError:
        raise ValueError(f"{CAPABILITY_VARIABLE}={text!r} must read like 9.0 or 10.0") from None
    return major, minor


def cuda_version() -> str:
    """What `torch.version.cuda` would say on the double's machine (TE parses it with float())."""
    text = os.environ.get(CUDA_VERSION_VARIABLE, DEFAULT_CUDA_VERSION)
    try:
        float(text)
    except ValueError:
        raise ValueError(f"{CUDA_VERSION_VARIABLE}={text!r} must read like 12.8 or 13.0") from None
    return text


def get_cublasLt_version() -> int:  # noqa: N802 (TE's name, transformer_engine_torch)
    """What `tex.get_cublasLt_version()` would return (cublasLtGetVersion: 120103 = 12.1.3)."""
    text = os.environ.get(CUBLASLT_VERSION_VARIABLE)
    if text is None:
        major, minor = (cuda_version().split(".") + ["0"])[:2]
        return int(major) * 10000 + int(minor) * 100
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{CUBLASLT_VERSION_VARIABLE}={text!r} must be an integer such as 120103") from None


def is_non_tn_fp8_gemm_supported() -> bool:
    """TE 2.14 utils.py:523-528: FP8 GEMMs take non-TN layouts on SM100-119 and SM130+."""
    capability = get_device_compute_capability()
    return (10, 0) <= capability < (12, 0) or capability >= (13, 0)


def check_dim_for_fp8_exec(tensor: torch.Tensor) -> bool:
    """TE 2.14 utils.py:474-476."""
    return tensor.dim() == 2 and tensor.size(0) % 8 == 0 and tensor.size(1) % 16 == 0


def assert_dim_for_fp8_exec(*tensors: torch.Tensor) -> None:
    """TE 2.14 utils.py:479-489, called on (input, weight) by every quantized linear forward."""
    for tensor in tensors:
        if math.prod(tensor.shape[:-1]) % 8 != 0 or tensor.shape[-1] % 16 != 0:
            raise ValueError(
                "FP8 execution requires the product of all dimensions except the last to be"
                " divisible by 8 and the last dimension to be divisible by 16, but got tensor"
                f" with dims={list(tensor.size())} (product of leading dims ="
                f" {math.prod(tensor.shape[:-1])}, last dim = {tensor.shape[-1]})"
            )
