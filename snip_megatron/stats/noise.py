"""Deterministic noise for the two noise passes, identical whatever the TP/SP/CP/PP/DP split.

Noise for a layer is drawn for the whole tensor (every TP shard of the features, the whole
sequence) from a dedicated generator seeded by (seed, layer, linear, micro-batch, stream), then
this rank's part is sliced out: features as Megatron shards them over TP (`shard_indices`), and
sequence positions as sequence parallelism (contiguous blocks over TP) and context parallelism
(Megatron's 2 x CP load-balanced chunks) cut them (`token_positions`). So any split injects exactly
the noise a single process would, and the global RNG streams are never touched.

The noise is a pure function of its seed and indices, so the hooks regenerate it where they need
it (forward and backward) instead of keeping it until the backward; `NoiseField.chunks` yields it
a block of rows at a time, so no full-size float copy is ever needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snip_megatron.models.order import key_index
from snip_megatron.plan import LayerKey

FORWARD, BACKWARD = 0, 1
WORD_BITS = 32
CHUNK_ELEMS = 1 << 22  # rows are unpacked this many elements at a time (4 bytes each)


def noise_seed(seed: int, key: LayerKey, microbatch: int, stream: int) -> int:
    idx = key_index(key) * 2 + stream
    return (seed * 1_000_003 + idx * 10_007 + microbatch) % (2**63 - 1)


def shard_indices(full: int, tp_rank: int, tp_size: int, stride: int = 1, device=None) -> torch.Tensor:
    """Indices of this rank's shard along a partitioned dim, as Megatron lays weights out:
    the dim is cut into tp_size*stride chunks and rank r holds chunks r, r+tp, r+2tp, ..."""
    chunk = full // (tp_size * stride)
    return torch.cat([torch.arange((s * tp_size + tp_rank) * chunk, (s * tp_size + tp_rank + 1) * chunk,
                                   device=device) for s in range(stride)])


def token_positions(local_len: int, *, sp_rank: int = 0, sp_size: int = 1, cp_rank: int = 0,
                    cp_size: int = 1, device=None) -> "torch.Tensor | None":
    """Positions in the whole sequence of this rank's `local_len` rows along the sequence dim.

    Context parallelism gives rank r chunks r and 2cp-1-r of 2cp equal chunks (Megatron's
    `get_batch_on_this_cp_rank`); sequence parallelism then cuts that local sequence into sp_size
    contiguous blocks. None when this rank holds the whole sequence."""
    if sp_size == 1 and cp_size == 1:
        return None
    cp_len = local_len * sp_size
    if cp_size > 1:
        if cp_len % 2:
            raise ValueError(f"context parallelism needs an even local sequence, got {cp_len}")
        half = cp_len // 2
        cp_pos = torch.cat([torch.arange(cp_rank * half, (cp_rank + 1) * half, device=device),
                            torch.arange((2 * cp_size - 1 - cp_rank) * half, (2 * cp_size - cp_rank) * half,
                                         device=device)])
    else:
        cp_pos = torch.arange(cp_len, device=device)
    return cp_pos[sp_rank * local_len:(sp_rank + 1) * local_len]


_ONE = 0x3F800000  # float32 1.0; setting bit 31 makes it -1.0
_SIGN = -(1 << 31)  # int32 with only bit 31 set
_SHIFTS: dict = {}  # device -> 31 - arange(WORD_BITS) as int32, made once


def _signs(words: torch.Tensor) -> torch.Tensor:
    """Random words [..., w] (int64 < 2**32) -> +-1 float32 [..., w * 32], bit b of word i -> entry
    32 i + b. The low 32 bits go through int32 (the same bit pattern), so the unpacking costs 4
    bytes per entry, not 8."""
    w32 = words.to(torch.int32)
    shifts = _SHIFTS.get(words.device)
    if shifts is None:  # bit b moves to the sign bit
        shifts = _SHIFTS[words.device] = WORD_BITS - 1 - torch.arange(WORD_BITS, dtype=torch.int32, device=words.device)
    bits = w32.unsqueeze(-1) << shifts
    del w32
    bits.bitwise_and_(_SIGN).bitwise_or_(_ONE)  # in place: one int32 per entry
    return bits.view(torch.float32).reshape(*words.shape[:-1], -1)


def rademacher(shape, generator: torch.Generator) -> torch.Tensor:
    """Independent +-1 entries (float32), 32 from each random word: a few integer ops per entry
    instead of a Gaussian draw, and the minimum-variance choice for Hutchinson's estimator."""
    numel = 1
    for d in shape:
        numel *= int(d)
    words = _words(numel, generator, generator.device)
    return _signs(words.unsqueeze(0)).reshape(-1)[:numel].reshape(shape)


def _words(numel: int, generator: torch.Generator, device) -> torch.Tensor:
    return torch.randint(0, 2**32, ((numel + WORD_BITS - 1) // WORD_BITS,), generator=generator,
                         dtype=torch.int64, device=device)


def _generator(seed: int, device) -> torch.Generator:
    device = torch.device(device) if device is not None else torch.device("cpu")
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class NoiseField:
    """The noise of one layer, micro-batch and stream, as seen by this rank: a tensor of
    `local_shape` ([seq, ...] activations) cut from the whole one."""

    seed: int
    key: LayerKey
    microbatch: int
    stream: int
    local_shape: tuple
    tp_rank: int = 0
    tp_size: int = 1
    sharded: bool = False
    """The last dim is this rank's TP shard (a tensor tp_size times wider, cut as `shard_indices`)."""
    stride: int = 1
    positions: "torch.Tensor | None" = None
    """Positions of the local rows along dim 0 in the whole sequence (`token_positions`); None:
    dim 0 is whole."""
    full_len: int = 0
    """Length of dim 0 of the whole tensor (with `positions`)."""

    def _full_shape(self) -> list:
        full = list(self.local_shape)
        if self.sharded and self.tp_size > 1:
            full[-1] *= self.tp_size
        if self.positions is not None:
            full[0] = self.full_len
        return full

    def chunks(self, device=None, max_elems: int = CHUNK_ELEMS):
        """Yield (row slice of dim 0, float32 noise of those rows) covering the local tensor; the
        caller may overwrite a block (no two share memory, and none is used again)."""
        full = self._full_shape()
        lead = full[0] if full else 1
        inner = 1
        for d in full[1:]:
            inner *= int(d)
        width = full[-1] if len(full) > 1 else 1
        g = _generator(noise_seed(self.seed, self.key, self.microbatch, self.stream), device)
        words = _words(lead * inner, g, g.device)
        cols = None
        if self.sharded and self.tp_size > 1:
            cols = shard_indices(width, self.tp_rank, self.tp_size, self.stride, device=words.device)
        rows_local = self.local_shape[0] if self.local_shape else 1
        step = max(1, max_elems // max(inner, 1))
        aligned = inner % WORD_BITS == 0 and (cols is None or (width // (self.tp_size * self.stride)) % WORD_BITS == 0)
        pos = self.positions  # built on the noise's device (token_positions(device=...))
        whole = None if aligned else _signs(words.unsqueeze(0)).reshape(-1)[:lead * inner].view(lead, inner)
        for r0 in range(0, rows_local, step):
            r1 = min(rows_local, r0 + step)
            rows = pos[r0:r1] if pos is not None else None
            if aligned:  # whole words per row and per shard: unpack only this rank's words
                w = words.view(lead, inner // WORD_BITS)
                w = w[r0:r1] if rows is None else w.index_select(0, rows)  # local rows: a view
                if cols is not None:
                    wcols = cols.view(-1, WORD_BITS)[:, 0] // WORD_BITS
                    w = w.view(r1 - r0, -1, width // WORD_BITS).index_select(-1, wcols)
                z = _signs(w)
            else:  # small or odd shapes: every word unpacked once, then sliced
                z = whole[r0:r1] if rows is None else whole.index_select(0, rows)  # rows of its own
                if cols is not None:
                    z = z.view(r1 - r0, -1, width).index_select(-1, cols)
            yield slice(r0, r1), z.reshape(r1 - r0, *self.local_shape[1:])

    def full(self, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole local noise tensor."""
        out = torch.empty(self.local_shape, dtype=dtype, device=device)
        for rows, z in self.chunks(device):
            out[rows] = z.to(dtype)
        return out


def layer_noise(local_shape: torch.Size, *, seed: int, key: LayerKey, microbatch: int, stream: int,
                tp_rank: int = 0, tp_size: int = 1, sharded: bool = False, stride: int = 1,
                positions: "torch.Tensor | None" = None, full_len: int = 0,
                dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Rademacher (+-1) noise of `local_shape`; when `sharded`, the last dim is this rank's shard
    of a tensor tp_size times wider, cut as Megatron cuts it (see `shard_indices`); with
    `positions`, dim 0 holds those positions of a tensor `full_len` long (`token_positions`)."""
    return NoiseField(seed=seed, key=key, microbatch=microbatch, stream=stream,
                      local_shape=tuple(int(d) for d in local_shape), tp_rank=tp_rank, tp_size=tp_size,
                      sharded=sharded, stride=stride, positions=positions,
                      full_len=full_len).full(device, dtype)
