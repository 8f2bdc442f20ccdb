"""Token samples of one micro-batch, and the squared norm of a weight gradient from a sample.

Rows are the tokens of a [seq, batch, features] activation flattened to [seq * batch, features]
(the layout the GEMMs contract). A sample keeps every `stride`-th chunk of TOKEN_CHUNK consecutive
rows: whole chunks, so NVFP4 blocks and its 16-point Hadamard along tokens see their real
neighbours, and small chunks, so the sample spreads over all sequence positions (a
position-clustered sample is biased: early positions differ). Indices are built on the device
from the row count alone, so sampling never waits for the GPU.

||G_W||^2 = ||G_Y^T X||^2 is not a sum over tokens, so a sample cannot just be scaled up. With
the tokens cut into chunks c, G_W = sum_c A_c (A_c = G_c^T X_c) and
    ||G_W||^2 = sum_c ||A_c||^2 + sum_{c != c'} <A_c, A_c'>.
The first sum is exact and cheap for every chunk: ||A_c||^2 = <G_c G_c^T, X_c X_c^T>, two 16 x 16
Gram matrices per chunk (about 16 / k of the GEMM's work). The cross sum is estimated from the
sampled chunks S: (||sum_S A_c||^2 - sum_S ||A_c||^2) times the ratio of chunk pairs,
C (C-1) / (s (s-1)). Exact with stride 1; unbiased for a random sample of chunks; right both for
a coherent gradient (cross terms dominate) and for noise (the chunk terms dominate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN_CHUNK = 16
BLOCK_ELEMS = 1 << 22  # elements converted to float32 at a time (norms, Grams): 16 MiB temporaries


def _block(t2: torch.Tensor, multiple: int = 1) -> int:
    """Rows per block of a [rows, d] tensor (a multiple of `multiple`)."""
    return max(multiple, BLOCK_ELEMS // max(t2.shape[1], 1) // multiple * multiple)


@dataclass(frozen=True)
class Sample:
    """The sampled rows of an n-row tensor."""

    n: int
    stride: int
    rows: "torch.Tensor | None"
    """Row indices (on the tensor's device), None when every row is kept."""
    kept: int
    chunks: int
    """Chunks of TOKEN_CHUNK rows in the tensor (the last may be partial)."""
    picked: int
    """Sampled chunks (chunk c is sampled when c % stride == 0)."""

    @property
    def scale(self) -> float:
        """Scales a sum over the sampled rows up to a sum over all rows."""
        return self.n / self.kept

    def take(self, t2: torch.Tensor) -> torch.Tensor:
        """The sampled rows, as float32."""
        return (t2 if self.rows is None else t2.index_select(0, self.rows)).float()

    def count_below(self, row: int) -> int:
        """How many sampled rows lie below `row` (a host number: no device work)."""
        if self.rows is None:
            return min(row, self.n)
        row = min(row, self.n)
        whole = row // TOKEN_CHUNK  # chunks entirely below `row`
        below = TOKEN_CHUNK * (-(-whole // self.stride))
        if whole % self.stride == 0:
            below += row - TOKEN_CHUNK * whole
        return below

    def chunk_ids(self, device) -> torch.Tensor:
        return torch.arange(0, self.chunks, self.stride if self.rows is not None else 1, device=device)


def sample_rows(n: int, stride: int, device=None, min_chunks: int = 1) -> Sample:
    """Every stride-th chunk of TOKEN_CHUNK rows; all rows with stride 1, or when fewer than
    `min_chunks` chunks would be sampled, or n < stride * TOKEN_CHUNK."""
    chunks = -(-n // TOKEN_CHUNK)
    picked = -(-chunks // stride)
    if stride == 1 or n < stride * TOKEN_CHUNK or picked < min_chunks:
        return Sample(n=n, stride=1, rows=None, kept=n, chunks=chunks, picked=chunks)
    last = n - TOKEN_CHUNK * (picked - 1) * stride  # rows of the last sampled chunk
    kept = TOKEN_CHUNK * (picked - 1) + min(TOKEN_CHUNK, last)
    j = torch.arange(kept, device=device)
    rows = (j // TOKEN_CHUNK) * (stride * TOKEN_CHUNK) + j % TOKEN_CHUNK
    return Sample(n=n, stride=stride, rows=rows, kept=kept, chunks=chunks, picked=picked)


def _rows2(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)


def sum_sq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares as a float32 0-dim tensor, BLOCK_ELEMS at a time."""
    t2 = _rows2(t)
    b = _block(t2)
    if t2.shape[0] <= b:
        return t2.float().pow(2).sum()
    return sum(t2[r:r + b].float().pow(2).sum() for r in range(0, t2.shape[0], b))


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """<a, b> as a float32 0-dim tensor (blocks, as sum_sq)."""
    a2, b2 = _rows2(a), _rows2(b)
    blk = _block(a2)
    if a2.shape[0] <= blk:
        return (a2.float() * b2.float()).sum()
    return sum((a2[r:r + blk].float() * b2[r:r + blk].float()).sum() for r in range(0, a2.shape[0], blk))


def chunk_grams(t2: torch.Tensor) -> torch.Tensor:
    """[C, 16, 16] Gram matrices T_c T_c^T of the row chunks (the last one zero-padded), float32."""
    n, d = t2.shape
    out = torch.empty(-(-n // TOKEN_CHUNK), TOKEN_CHUNK, TOKEN_CHUNK, dtype=torch.float32, device=t2.device)
    block = _block(t2, TOKEN_CHUNK)
    for r0 in range(0, n, block):
        part = t2[r0:r0 + block].float()
        pad = -part.shape[0] % TOKEN_CHUNK
        if pad:
            part = torch.nn.functional.pad(part, (0, 0, 0, pad))
        part = part.reshape(-1, TOKEN_CHUNK, d)
        c0 = r0 // TOKEN_CHUNK
        torch.bmm(part, part.transpose(1, 2), out=out[c0:c0 + part.shape[0]])
    return out


class WgradNormEstimate:
    """||G^T X||^2 of one micro-batch (g2, x2: [n, *] rows of the same tokens) from the chunk
    Grams of every token and ||G_s^T X_s||^2 on the sampled chunks (the caller accumulates that,
    e.g. over blocks of weight rows, and passes it to `value`)."""

    def __init__(self, g2: torch.Tensor, x2: torch.Tensor, sample: Sample):
        self.sample = sample
        if sample.rows is None:  # no sample: the caller's sum is exact
            return
        prod = (chunk_grams(g2) * chunk_grams(x2)).sum((1, 2))  # ||A_c||^2 per chunk
        self.diag_all = prod.sum()
        self.diag_sampled = prod.index_select(0, sample.chunk_ids(prod.device)).sum()

    def value(self, sampled_sq: torch.Tensor) -> torch.Tensor:
        """The estimate of ||G^T X||^2, given ||sum over sampled chunks of A_c||^2."""
        s = self.sample
        if s.rows is None:
            return sampled_sq
        pairs = s.chunks * (s.chunks - 1) / (s.picked * (s.picked - 1))
        return self.diag_all + pairs * (sampled_sq - self.diag_sampled)
