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
