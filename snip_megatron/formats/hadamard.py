"""The random Hadamard transform (RHT) applied to both wgrad operands along the token dimension.

M = H_h diag(s) / sqrt(h), with H_h the Sylvester Hadamard matrix and s a fixed random sign
vector, is orthogonal (M^T M = I), so transforming both operands of G_W = G_Y^T X in the same
h-token chunks leaves the product unchanged while spreading outliers across each chunk.
"""

from __future__ import annotations

import functools
import math

import torch

from snip_megatron.formats.constants import HADAMARD_SIGN_SEED


@functools.lru_cache(maxsize=None)
def _matrix_cpu(size: int) -> torch.Tensor:
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    # Fixed seed: the same sign vector on every rank and in every run.
    gen = torch.Generator().manual_seed(HADAMARD_SIGN_SEED)
    signs = torch.randint(0, 2, (size,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    return h * signs / math.sqrt(size)


_DEVICE_CACHE: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def hadamard_matrix(size: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """The orthogonal size x size matrix M (rows: output coordinates)."""
    key = (size, torch.device(device), dtype)
    if key not in _DEVICE_CACHE:
        _DEVICE_CACHE[key] = _matrix_cpu(size).to(device=device, dtype=dtype)
    return _DEVICE_CACHE[key]


def hadamard_last_dim(x: torch.Tensor, size: int, *, inverse: bool = False) -> torch.Tensor:
    """Apply M (or M^T) to every chunk of `size` consecutive elements of the last dim
    (its length must be a multiple of `size`)."""
    if x.shape[-1] % size:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the Hadamard size {size}")
    m = hadamard_matrix(size, x.device, x.dtype)
    chunks = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
    # Row chunk v^T -> (M v)^T = v^T M^T; the inverse is v^T M.
    out = chunks @ (m if inverse else m.t())
    return out.reshape(x.shape)
