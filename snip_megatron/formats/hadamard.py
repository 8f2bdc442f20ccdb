"""The random Hadamard transform (RHT) applied to both wgrad operands along the token dimension.

M = H_h diag(s) / sqrt(h), with H_h the Sylvester Hadamard matrix and s a fixed random sign
vector (for h = 16, Transformer Engine's: TE multiplies x @ diag(s) H / 4, the same M since H is
symmetric), is orthogonal (M^T M = I), so transforming both operands of G_W = G_Y^T X in the same
h-token chunks leaves the product unchanged while spreading outliers across each chunk.

`hadamard_last_dim` computes M v in a fixed order, so that its float32 result does not depend on
a BLAS's summation order and the CPU kernel (csrc/quantize_cpu.cpp, `quantize_hadamard`)
computes the same bits: the signs (exact), the fast Walsh-Hadamard butterflies
(a, b) -> (a + b, a - b) over element distances 1, 2, 4, ..., h/2 in that order, then the factor
1/sqrt(h) (exact for h = 16: 0.25). The inverse M^T w is the butterflies first, then signs times
the factor.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from snip_megatron.formats.constants import HADAMARD_SIGN_SEED, HADAMARD_SIGNS_16


@functools.lru_cache(maxsize=None)
def _matrix_cpu(size: int) -> torch.Tensor:
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if size == 16:  # Transformer Engine's signs (constants.HADAMARD_SIGNS_16)
        signs = torch.tensor(HADAMARD_SIGNS_16, dtype=torch.float64)
    else:  # fixed seed: the same sign vector on every rank and in every run
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


def hadamard_signs(size: int) -> torch.Tensor:
    """The fixed random sign vector s (float64 CPU, entries +-1) of the size-`size` transform."""
    return _matrix_cpu(size)[0] * math.sqrt(size)  # row 0 of H is all ones: M[0] = s / sqrt(h)


@functools.lru_cache(maxsize=None)
def hadamard_factor(size: int) -> float:
    """1/sqrt(size) as the float32 the transform multiplies by (rounded on the host: no tensor)."""
    return struct.unpack("f", struct.pack("f", 1.0 / math.sqrt(size)))[0]


def hadamard_last_dim(x: torch.Tensor, size: int, *, inverse: bool = False) -> torch.Tensor:
    """Apply M (or M^T) to every chunk of `size` consecutive elements of the last dim (its length
    must be a multiple of `size`), in the order the module docstring fixes."""
    if x.shape[-1] % size:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the Hadamard size {size}")
    hadamard_matrix(size)  # checks the size
    key = (size, x.device, x.dtype)
    if key not in _SIGN_CACHE:
        signs = hadamard_signs(size)
        _SIGN_CACHE[key] = (signs.to(device=x.device, dtype=x.dtype),
                            (signs * hadamard_factor(size)).to(device=x.device, dtype=x.dtype))
    signs, signed_factor = _SIGN_CACHE[key]
    chunks = x.reshape(-1, size)
    if inverse:
        return (_butterflies(chunks) * signed_factor).reshape(x.shape)
    return (_butterflies(chunks * signs) * hadamard_factor(size)).reshape(x.shape)


_SIGN_CACHE: dict = {}


def _butterflies(y: torch.Tensor) -> torch.Tensor:
    """H y for rows y of length h (Sylvester order, unnormalized): (a, b) -> (a + b, a - b) at
    distances 1, 2, ..., h/2."""
    n, size = y.shape
    h = 1
    while h < size:
        pairs = y.reshape(n, size // (2 * h), 2, h)
        out = torch.empty_like(pairs)
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 1])
        y = out.reshape(n, size)
        h *= 2
    return y
