"""Stochastic-rounding noise from a counter-based generator: U[0, 1) as a pure function of
(seed, row, column), so a kernel can draw it in registers and the eager paths draw the same bits.

Element (r, c) of a tensor's 2D view (all leading dims, last dim) gets

    k0 = mix(mix(r ^ seed_lo) ^ seed_hi)        per row
    k1 = mix(k0 ^ 0x9E3779B9)
    u  = (mix(mix((c + col_offset) ^ k0) ^ k1) >> 8) * 2**-24

with `mix` the 32-bit integer hash "lowbias32" (two multiply-xorshift rounds, a bijection with
full avalanche) and all arithmetic mod 2**32. u takes the 2**24 values k * 2**-24, as
`torch.rand`'s float32 draws do, which is all the E2M1 rounding reads (floor(|y| / step + u)).
The seed enters every round, so two seeds give unrelated streams, not shifted copies of one.
`col_offset` is the shard's first column in the full last dim: a tensor-parallel shard draws the
full tensor's noise for its columns without drawing the rest (TP=N rounds as TP=1). A strided
shard (Megatron's `partition_stride`, e.g. the [gate, up] halves of a gated fc1) holds several
column chunks: `shard_noise` draws each at its own offset.

The compiled CPU kernel (csrc/quantize_cpu.cpp, `noise_bits`) computes the same formula;
`uniform` here is its torch form (any device), used by the reference and the eager paths.

Each stochastic cast takes one seed, drawn on the host so that no cast waits for a device: from a
`SeedStream` (a counter; the emulated linears' streams) or, by `draw_seed`, from a CPU
torch.Generator (a device generator through its CPU twin).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

_MASK = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
_MIX = (0x7FEB352D, 0x846CA68B)
_GOLDEN = 0x9E3779B9


class CounterNoise(NamedTuple):
    """The noise of one stochastic-rounding cast: its seed and the shard's column offset."""

    seed: int
    """64 bits (an int in [0, 2**64))."""
    col_offset: int = 0
    """The tensor's first column in the full (unsharded) last dim."""

    def uniform(self, shape, device="cpu") -> torch.Tensor:
        """The float32 U[0, 1) noise of a tensor of `shape` (its 2D view: leading dims x last)."""
        shape = tuple(shape)
        cols = shape[-1] if shape else 1
        rows = 1
        for d in shape[:-1]:
            rows *= d
        _check_range(rows, cols + self.col_offset)
        seed_lo, seed_hi = self.seed & _MASK, (self.seed >> 32) & _MASK
        r = torch.arange(rows, dtype=torch.int64, device=device)
        k0 = _mix(_mix(r ^ seed_lo) ^ seed_hi)  # per row: int64 is cheap here
        k1 = _mix(k0 ^ _GOLDEN)
        c = torch.arange(self.col_offset, self.col_offset + cols, dtype=torch.int64, device=device)
        # per element: int32 holding the uint32 bits, in place (a quarter of int64's traffic)
        bits = torch.bitwise_xor(_as_int32(c)[None, :], _as_int32(k0)[:, None])
        tmp = torch.empty_like(bits)
        _mix32_(bits, tmp).bitwise_xor_(_as_int32(k1)[:, None])
        _mix32_(bits, tmp).bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)
        return bits.to(torch.float32).mul_(2.0**-24).reshape(shape)


def shard_noise(seed: int, shape, *, rank: int = 0, world: int = 1, stride: int = 1,
                device="cpu") -> "CounterNoise | torch.Tensor":
    """The whole tensor's noise at the columns of this tensor-parallel shard of `shape`, as Megatron
    lays a partitioned dim out (`stats/noise.py` shard_indices: world * stride chunks, rank r
    holding chunks r, r + world, ...). Contiguous columns (stride 1) stay a CounterNoise (the
    kernel draws it); a strided shard's noise is the U[0, 1) tensor, one chunk at a time."""
    cols = shape[-1]
    if stride == 1 or world == 1:
        return CounterNoise(seed, col_offset=rank * cols)
    if cols % stride:
        raise ValueError(f"a shard of {cols} columns cannot hold {stride} equal chunks")
    chunk = cols // stride
    lead = tuple(shape[:-1])
    return torch.cat([CounterNoise(seed, col_offset=(s * world + rank) * chunk).uniform((*lead, chunk), device)
                      for s in range(stride)], dim=-1)


class KernelNoise(NamedTuple):
    """Counter-based noise as the CPU kernel draws it: the generator's parameters and the natural
    2D shape (rows, cols) it counts over; `transposed`: the kernel's rows are the natural columns."""

    noise: CounterNoise
    transposed: bool
    rows: int
    cols: int


def stochastic_noise(noise, generator, tensor):
    """The noise of a stochastic cast of `tensor`: a U[0, 1) tensor of its shape (`noise` given
    as one), or a `CounterNoise` (given, or seeded from `generator`: one draw, so each cast gets
    its own stream)."""
    if noise is None:
        if generator is None:
            raise ValueError("stochastic rounding needs generator= or noise=")
        return CounterNoise(draw_seed(generator))
    if isinstance(noise, CounterNoise):
        return noise
    if noise.shape != tensor.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != tensor shape {tuple(tensor.shape)}")
    return noise


class SeedStream:
    """Stochastic-rounding seeds counted on the host: the n-th seed is splitmix64 of (seed, n), a
    pure function of both. Drawing one never waits for a device, and a CPU run and a GPU run with
    the same seed draw the same seeds (so round alike). Restart it with a new `SeedStream`."""

    def __init__(self, seed: int):
        self.seed = int(seed) & _MASK64
        self.drawn = 0
        """Seeds drawn so far."""

    def next_seed(self) -> int:
        self.drawn += 1
        return _splitmix64((self.seed + self.drawn * _GOLDEN64) & _MASK64)

    def __repr__(self) -> str:
        return f"SeedStream(seed={self.seed}, drawn={self.drawn})"


def draw_seed(generator: "SeedStream | torch.Generator") -> int:
    """A 64-bit seed from `generator` (advancing it: each cast gets its own stream). A torch
    generator on a device is read through its host twin, a CPU generator seeded with its initial
    seed: reading the device generator's draw would wait for the device (a host sync per cast)."""
    if isinstance(generator, SeedStream):
        return generator.next_seed()
    if generator.device.type != "cpu":
        generator = _host_twin(generator)
    words = torch.randint(0, 1 << 32, (2,), generator=generator, dtype=torch.int64).tolist()
    return words[0] | (words[1] << 32)


_TWINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _host_twin(generator: torch.Generator) -> torch.Generator:
    """The CPU generator that stands for a device generator in `draw_seed`: seeded with its initial
    seed, re-seeded when that changes (the device generator's own state is never read)."""
    seed = generator.initial_seed()
    kept = _TWINS.get(generator)
    if kept is None or kept[0] != seed:
        kept = _TWINS[generator] = (seed, torch.Generator().manual_seed(seed))
    return kept[1]


def _splitmix64(z: int) -> int:
    # Vigna's splitmix64 finaliser: a bijection of 64-bit ints with full avalanche.
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _check_range(rows: int, cols: int) -> None:
    if rows > 1 << 32 or cols > 1 << 32:
        raise ValueError(f"stochastic-rounding noise counts rows and columns in 32 bits; got a "
                         f"{rows} x {cols} tensor")


def _mul32(x: torch.Tensor, const: int) -> torch.Tensor:
    # x * const mod 2**32 for x in [0, 2**32) without overflowing int64: the constant in 16-bit
    # halves (each partial product < 2**48).
    hi = (x * (const >> 16)) & 0xFFFF
    return ((hi << 16) + x * (const & 0xFFFF)) & _MASK


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding uint32 values -> int32 with the same 32 bits."""
    return (x - ((x >> 31) << 32)).to(torch.int32)


_MIX_I32 = tuple(c - (1 << 32) if c >= 1 << 31 else c for c in _MIX)  # the constants' bits as int32


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on int32 tensors holding uint32 bits: int32 products wrap mod 2**32 (the
    uint32 product's bits), and each right shift is masked to the logical shift's bits."""
    for shift, const in ((16, _MIX_I32[0]), (15, _MIX_I32[1])):
        torch.bitwise_right_shift(x, shift, out=tmp).bitwise_and_((1 << (32 - shift)) - 1)
        x.bitwise_xor_(tmp).mul_(const)
    torch.bitwise_right_shift(x, 16, out=tmp).bitwise_and_(0xFFFF)
    return x.bitwise_xor_(tmp)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX[1])
    return x ^ (x >> 16)
