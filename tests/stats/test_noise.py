"""The noise of the two noise passes: +-1 entries, reproducible, the same whatever the TP split."""

import torch

from snip_megatron.plan import LayerKey
from snip_megatron.stats import noise

KEY = LayerKey(2, "linear_fc1")


def test_rademacher_entries_are_balanced_signs():
    z = noise.rademacher((257, 33), torch.Generator().manual_seed(0))  # not a multiple of 32
    assert z.shape == (257, 33) and z.dtype == torch.float32
    assert set(z.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(z.mean())) < 0.02  # 8481 fair signs: 4 sigma is 0.043
    # neighbours are uncorrelated (the bits of one word are independent)
    flat = z.reshape(-1)
    assert abs(float((flat[1:] * flat[:-1]).mean())) < 0.05


def test_layer_noise_is_reproducible_and_distinct_per_stream():
    a = noise.layer_noise((4, 8, 16), seed=1, key=KEY, microbatch=0, stream=noise.FORWARD)
    assert torch.equal(a, noise.layer_noise((4, 8, 16), seed=1, key=KEY, microbatch=0, stream=noise.FORWARD))
    for other in (dict(seed=2, microbatch=0, stream=noise.FORWARD), dict(seed=1, microbatch=1, stream=noise.FORWARD),
                  dict(seed=1, microbatch=0, stream=noise.BACKWARD)):
        assert not torch.equal(a, noise.layer_noise((4, 8, 16), key=KEY, **other))
    assert float((a * a).sum()) == a.numel()  # ||z||^2 = numel exactly


def test_tp_shards_are_slices_of_the_single_process_noise():
    full = noise.layer_noise((3, 5, 32), seed=4, key=KEY, microbatch=2, stream=noise.FORWARD)
    for stride in (1, 2):
        parts = [noise.layer_noise((3, 5, 16), seed=4, key=KEY, microbatch=2, stream=noise.FORWARD,
                                   tp_rank=r, tp_size=2, sharded=True, stride=stride) for r in range(2)]
        for r, part in enumerate(parts):
            assert torch.equal(part, full.index_select(-1, noise.shard_indices(32, r, 2, stride)))


def test_token_positions_follow_megatron_cp_and_sp_layouts():
    from snip_megatron.stats.noise import token_positions

    assert token_positions(8) is None
    # CP=2: 4 chunks of 2 positions of a sequence of 8; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert token_positions(4, cp_rank=0, cp_size=2).tolist() == [0, 1, 6, 7]
    assert token_positions(4, cp_rank=1, cp_size=2).tolist() == [2, 3, 4, 5]
    # SP=2 cuts the local sequence in contiguous halves
    assert token_positions(4, sp_rank=1, sp_size=2).tolist() == [4, 5, 6, 7]
    # both: SP splits the CP rank's (load-balanced) local sequence
    assert token_positions(2, sp_rank=1, sp_size=2, cp_rank=0, cp_size=2).tolist() == [6, 7]


def test_sequence_and_context_shards_are_slices_of_the_whole_sequence():
    """The noise of an SP/CP rank's tokens (and TP features) is the single process's noise at
    those positions, also on the fast path that unpacks only this rank's random words."""
    from snip_megatron.stats.noise import token_positions

    seq, batch = 16, 2
    for width, tp_size in ((32, 1), (128, 2), (48, 2)):  # 128/2: whole words per shard; 48/2: not
        full = noise.layer_noise((seq, batch, width), seed=5, key=KEY, microbatch=1, stream=noise.BACKWARD)
        for cp_size, sp_size in ((2, 1), (1, 2), (2, 2)):
            for cp_rank in range(cp_size):
                for sp_rank in range(sp_size):
                    local = seq // cp_size // sp_size
                    pos = token_positions(local, sp_rank=sp_rank, sp_size=sp_size, cp_rank=cp_rank,
                                          cp_size=cp_size)
                    for tp_rank in range(tp_size):
                        part = noise.layer_noise((local, batch, width // tp_size), seed=5, key=KEY,
                                                 microbatch=1, stream=noise.BACKWARD, tp_rank=tp_rank,
                                                 tp_size=tp_size, sharded=tp_size > 1, positions=pos,
                                                 full_len=seq)
                        want = full.index_select(0, pos)
                        if tp_size > 1:
                            want = want.index_select(-1, noise.shard_indices(width, tp_rank, tp_size))
                        assert torch.equal(part, want), (width, tp_size, cp_size, sp_size, cp_rank, sp_rank)


def test_noise_in_row_blocks_equals_the_whole():
    field = noise.NoiseField(seed=2, key=KEY, microbatch=0, stream=noise.FORWARD, local_shape=(40, 3, 64))
    whole = field.full()
    parts = list(field.chunks(max_elems=3 * 64 * 7))  # 7 rows at a time
    assert len(parts) == 6
    assert torch.equal(torch.cat([z for _, z in parts]), whole)
