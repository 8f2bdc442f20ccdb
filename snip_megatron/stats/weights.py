"""A weight's quantization error, a block of rows at a time.

The statistics need E_W = Q(W) - W for each candidate precision, but never all of it at once:
every use (||E_W||^2, dY = E_X Q(W)^T + X E_W^T, <G_W, E_W>) is a sum over blocks of output rows.
So the error of each block is computed, consumed and freed, and a 70B fc1 shard (7168 x 8192)
never has more than one block's float32 copies alive.

Blocks are whole multiples of BLOCK_ROWS rows, so no quantization block (at most 128 x 128, FP8
blockwise) straddles two of them. Formats with a per-tensor scale (NVFP4's FP32 global scale,
tensorwise FP8) take it from the amax of the whole tensor (all TP shards): each block is quantized
with a sentinel block appended that holds that amax in one element (zeros elsewhere) and is
cropped afterwards. It is a block of its own, so it changes no other block, and it makes the
block's per-tensor amax the whole tensor's, so the result equals quantizing the whole tensor
(tests/stats/test_weights.py). NaN/Inf anywhere make the sentinel, and so every element of a
per-tensor-scaled format, non-finite, as for the whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

BLOCK_ROWS = 128
MAX_BLOCK_ELEMS = 1 << 22  # 16 MiB of float32 per weight-block copy


def block_rows(m: int, k: int, max_elems: int = MAX_BLOCK_ELEMS) -> int:
    """Rows per block of an m x k weight: all of them when small, else a multiple of BLOCK_ROWS."""
    if m * k <= max_elems:
        return m
    return max(BLOCK_ROWS, (max_elems // k) // BLOCK_ROWS * BLOCK_ROWS)


def _global_amax(w: torch.Tensor, group) -> torch.Tensor:
    amax = w.detach().abs().amax().float()
    amax = torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def error_blocks(w: torch.Tensor, error_fn, roles: dict, *, group=None,
                 rows: "int | None" = None) -> Iterator[tuple[slice, torch.Tensor, dict]]:
    """Yield (row slice, W block as float32, {precision: {role: E block}}) for the precisions and
    roles of `roles` ({precision: (role, ...)}).

    `group`: the TP group of a sharded weight (per-tensor scales see every shard)."""
    m, k = w.shape
    rows = rows or block_rows(m, k)
    if rows >= m:
        wf = w.detach().float()
        yield slice(0, m), wf, {p: {r: error_fn(wf, p, r, group=group) for r in rs} for p, rs in roles.items()}
        return
    if rows % BLOCK_ROWS:
        raise ValueError(f"weight blocks must be a multiple of {BLOCK_ROWS} rows, got {rows}")
    sentinel = torch.zeros(BLOCK_ROWS, k, dtype=torch.float32, device=w.device)
    sentinel[0, 0] = _global_amax(w, group)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        wf = w[r0:r1].detach().float()
        tail = -(r1 - r0) % BLOCK_ROWS  # zero rows, so the sentinel starts a block of its own
        padded = torch.cat([wf, sentinel.new_zeros(tail, k), sentinel] if tail else [wf, sentinel])
        yield slice(r0, r1), wf, {p: {r: error_fn(padded, p, r, group=None)[:r1 - r0] for r in rs}
                                  for p, rs in roles.items()}
