"""Which micro-batches a measurement samples, and which fields scale up to the step."""

import pytest

from snip_megatron.plan import all_keys
from snip_megatron.stats.config import MeasureConfig
from snip_megatron.stats.microbatches import sample_microbatches, step_positions, summed_mask
from snip_megatron.stats.table import StatsTable


def test_k_spread_over_replicas_and_the_step():
    assert sample_microbatches(1024, 0, 1, 8) == ([64, 192, 320, 448, 576, 704, 832, 960], 8)
    for dp, m, k in ((16, 64, 8), (4, 16, 8), (3, 5, 7), (2, 2, 2), (8, 1, 3)):
        picks = [sample_microbatches(m, d, dp, k)[0] for d in range(dp)]
        assert sum(map(len, picks)) == k and all(sample_microbatches(m, d, dp, k)[1] == k for d in range(dp))
        assert max(map(len, picks)) - min(map(len, picks)) <= 1  # each replica its share
        for p in picks:
            assert len(set(p)) == len(p) and all(0 <= i < m for i in p)
        assert picks == [sample_microbatches(m, d, dp, k)[0] for d in range(dp)]  # deterministic
    assert [len(sample_microbatches(64, d, 16, 8)[0]) for d in range(16)] == [0, 1] * 8  # every other replica


@pytest.mark.parametrize("k", [None, 0, 8, 100])
def test_all_microbatches(k):
    assert sample_microbatches(4, 1, 2, k) == ([0, 1, 2, 3], 8)


@pytest.mark.parametrize("m, dp, k", [(4, 1, None), (2, 2, None), (3, 4, 100), (2, 2, 2), (16, 4, 8), (5, 3, 7),
                                      (64, 16, 8), (8, 2, 1)])
def test_positions_number_the_steps_sample_in_the_steps_order(m, dp, k):
    """Replica d's micro-batch i is the step's d + dp * i; the positions number the sampled ones of
    all replicas 0..K-1 in that order, whatever the replica."""
    step_ids = sorted(d + dp * i for d in range(dp) for i in sample_microbatches(m, d, dp, k)[0])
    for d in range(dp):
        picked, total = sample_microbatches(m, d, dp, k)
        assert step_positions(m, d, dp, k) == [step_ids.index(d + dp * i) for i in picked]
    every = sorted(p for d in range(dp) for p in step_positions(m, d, dp, k))
    assert every == list(range(total))


def test_summed_fields_and_bad_k():
    t = StatsTable(keys=all_keys(1))
    mask = summed_mask(t)
    summed = {f for f, s in zip(t.fields, mask[0]) if s}
    assert {"x_sq", "n", "gy_sq", "gw_sq", "fwd_zg_noisy", "bwd_eta_sq", "ex.fp4", "dy_sq.fp8"} <= summed
    assert not summed & {"w_sq", "k", "m", "noise_scale", "present", "ew.fp4", "ew_d.fp8", "adam_du_sq"}
    assert not mask[-1].any()  # the run-level row
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="micro_batches"):
            MeasureConfig(micro_batches=bad)
    with pytest.raises(ValueError, match="at least one"):
        sample_microbatches(0, 0, 1, 8)


def test_whole_groups_for_the_interleaved_schedule():
    picks = [sample_microbatches(16, d, 4, 8, multiple=4) for d in range(4)]
    assert [len(p) for p, _ in picks] == [4, 4, 4, 4] and {k for _, k in picks} == {16}
    assert sample_microbatches(3, 0, 2, 2, multiple=4) == ([0, 1, 2], 6)  # capped at the replica's all
    assert sample_microbatches(64, 0, 16, 8, multiple=8) == ([], 64)  # replicas without a share stay at 0
    assert len(sample_microbatches(64, 1, 16, 8, multiple=8)[0]) == 8
