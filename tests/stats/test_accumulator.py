"""Queued device values sum exactly as one in-place add each, in order, across flushes."""

import torch

from snip_megatron.plan import LayerKey
from snip_megatron.stats import accumulator
from snip_megatron.stats.table import CANDIDATES


def test_queued_adds_equal_sequential_adds_bit_for_bit(monkeypatch):
    monkeypatch.setattr(accumulator, "FLUSH_EVERY", 3)  # flushes mid-way, and a partial queue at the end
    acc = accumulator.Accumulator([LayerKey(1, "linear_qkv"), LayerKey(1, "linear_fc1")], CANDIDATES, "cpu")
    want = torch.zeros_like(acc.values)
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        row, col = i % 2, (i * 7) % 4  # repeated cells: the order of the float64 sums matters
        v = torch.rand((), generator=g) * 10.0 ** (i % 7 - 3)  # float32 and float64 values mixed
        v = v.double() if i % 5 == 0 else v
        acc.add(row, col, v)
        want[row, col] += v
    acc.add(0, 1, 2.5)  # a host number
    want[0, 1] += 2.5
    assert len(acc.pending) == 20 % 3
    assert torch.equal(acc.tensor(), want)
    assert acc.pending == [] and torch.equal(acc.tensor(), want)  # reading twice adds nothing twice
