"""Deterministic noise for the two noise passes, identical whatever the TP/PP/DP split.

Noise for a layer is drawn for the whole unsharded tensor from a dedicated generator seeded by
(seed, layer, linear, micro-batch, stream), then this rank's shard is sliced out. So a TP=2 run
injects exactly the noise a single process would, and the global RNG streams are never touched.
"""

from __future__ import annotations

import torch

from snip_megatron.plan import LINEAR_NAMES, LayerKey

FORWARD, BACKWARD = 0, 1


def noise_seed(seed: int, key: LayerKey, microbatch: int, stream: int) -> int:
    idx = (key.layer * len(LINEAR_NAMES) + LINEAR_NAMES.index(key.name)) * 2 + stream
    return (seed * 1_000_003 + idx * 10_007 + microbatch) % (2**63 - 1)


def shard_indices(full: int, tp_rank: int, tp_size: int, stride: int = 1) -> torch.Tensor:
    """Indices of this rank's shard along a partitioned dim, as Megatron lays weights out:
    the dim is cut into tp_size*stride chunks and rank r holds chunks r, r+tp, r+2tp, ..."""
    chunk = full // (tp_size * stride)
    return torch.cat([torch.arange((s * tp_size + tp_rank) * chunk, (s * tp_size + tp_rank + 1) * chunk)
                      for s in range(stride)])


_BITS = torch.arange(32, dtype=torch.int64)
_ONE = 0x3F800000  # float32 1.0; setting bit 31 makes it -1.0


def rademacher(shape, generator: torch.Generator) -> torch.Tensor:
    """Independent +-1 entries (float32), 32 from each random word: a few integer ops per entry
    instead of a Gaussian draw, and the minimum-variance choice for Hutchinson's estimator."""
    numel = 1
    for d in shape:
        numel *= int(d)
    words = torch.randint(0, 2**32, ((numel + 31) // 32,), generator=generator, dtype=torch.int64)
    bits = ((words.unsqueeze(1) >> _BITS) & 1).reshape(-1)[:numel].to(torch.int32)
    return ((bits << 31) | _ONE).view(torch.float32).reshape(shape)


def layer_noise(local_shape: torch.Size, *, seed: int, key: LayerKey, microbatch: int, stream: int,
                tp_rank: int = 0, tp_size: int = 1, sharded: bool = False, stride: int = 1,
                dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Rademacher (+-1) noise of `local_shape`; when `sharded`, the last dim is this rank's shard
    of a tensor tp_size times wider, cut as Megatron cuts it (see `shard_indices`)."""
    g = torch.Generator().manual_seed(noise_seed(seed, key, microbatch, stream))
    if not sharded or tp_size == 1:
        z = rademacher(local_shape, g)
    else:
        full = list(local_shape)
        full[-1] *= tp_size
        z = rademacher(full, g).index_select(-1, shard_indices(full[-1], tp_rank, tp_size, stride))
    return z.to(device=device, dtype=dtype)
