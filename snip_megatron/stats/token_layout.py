"""Where a rank's token rows lie in its micro-batch, and the micro-batch's rows gathered in order,
under sequence and context parallelism.

Megatron's linears see [s, b, h] activations, flattened here to rows position-major (row =
position x b + sequence), so a cut of the positions is a cut of the rows. Context parallelism gives
CP rank r the position chunks r and 2 CP - 1 - r of 2 CP equal chunks, in that order (Megatron's
get_batch_on_this_cp_rank); sequence parallelism then cuts that rank's rows into TP contiguous
blocks. A hook that needs every token of the micro-batch (errors along tokens, G_W, dY) gathers
them: over TP (collector.py) and then over CP (`gather_cp_rows`), so it computes what one process
computes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class Segment(NamedTuple):
    """Rows [local, local + rows) of a rank's tensor are rows [whole, whole + rows) of the micro-batch."""
    local: int
    whole: int
    rows: int


def cp_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of 2 CP position chunks CP rank `cp_rank` holds, in its order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def row_segments(n: int, *, sp_rank: int = 0, sp_size: int = 1, cp_rank: int = 0,
                 cp_size: int = 1) -> list[Segment]:
    """Where this rank's `n` rows lie in the micro-batch: one segment, or one per CP chunk its
    (sequence-parallel) block of rows touches."""
    lo, hi = sp_rank * n, (sp_rank + 1) * n  # this TP rank's block of its CP rank's rows
    if cp_size == 1:
        return [Segment(0, lo, n)]
    half = n * sp_size // 2  # rows of one CP chunk
    out = []
    for i, chunk in enumerate(cp_chunks(cp_rank, cp_size)):
        a, b = max(lo, i * half), min(hi, (i + 1) * half)
        if a < b:
            out.append(Segment(a - lo, chunk * half + a - i * half, b - a))
    return out


def gather_cp_rows(t2: torch.Tensor, cp_size: int, group) -> torch.Tensor:
    """Every CP rank's rows of a [rows, features] tensor (each its whole share: gathered over TP
    first under sequence parallelism), as the micro-batch orders them."""
    if cp_size == 1:
        return t2
    rows = t2.shape[0]
    if rows % 2:
        raise ValueError(f"context parallelism needs an even number of rows per rank, got {rows}")
    half, t2 = rows // 2, t2.contiguous()
    out = t2.new_empty((rows * cp_size, t2.shape[1]))
    # chunks 0 .. CP-1 are the ranks' first halves in rank order: gathered in place
    dist.all_gather_into_tensor(out[:half * cp_size], t2[:half], group=group)
    # chunks CP .. 2 CP-1 are their second halves in reverse rank order
    second = t2.new_empty((half * cp_size, t2.shape[1]))
    dist.all_gather_into_tensor(second, t2[half:], group=group)
    for r in range(cp_size):
        chunk = cp_chunks(r, cp_size)[1]
        out[chunk * half:(chunk + 1) * half] = second[r * half:(r + 1) * half]
    return out
