"""The counter-based stochastic-rounding noise (formats/sr_noise.py): U[0, 1) at torch.rand's
resolution, independent across elements and seeds, pinned to its formula, and drawn bit for bit
alike by the CPU kernel, the eager fused path and the reference."""

import pytest
import torch

from snip_megatron.formats.cpu_kernel import eager_cpu_path
from snip_megatron.formats import Formats, Role, Rounding, quantize_for_role
from snip_megatron.formats.sr_noise import CounterNoise, SeedStream, draw_seed, shard_noise

NVFP4 = Formats().spec("fp4")
SR_ROLES = [r for r in Role if NVFP4.cast(r) is not None and NVFP4.cast(r).rounding is Rounding.STOCHASTIC]


def test_noise_is_uniform_on_the_24_bit_grid():
    u = CounterNoise(2**40 + 17).uniform((256, 1024)).reshape(-1)
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert torch.equal(u * 2**24, (u * 2**24).floor())  # k * 2**-24, as torch.rand's float32
    n = u.numel()
    # mean 1/2 and variance 1/12 within 5 standard errors
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 5 * (1 / 180 / n) ** 0.5
    # chi-square over 64 bins, 63 degrees of freedom: mean 63, sd 11.2; 130 is 6 sd out
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
    assert chi2 < 130, chi2


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.reshape(-1).double() - 0.5, b.reshape(-1).double() - 0.5
    return (a * b).mean().item() * 12


def test_noise_is_independent_across_neighbours_and_seeds():
    shape = (128, 512)
    u = CounterNoise(5).uniform(shape)
    bound = 5 / (shape[0] * shape[1] / 2) ** 0.5  # 5 standard errors of a correlation
    assert abs(_corr(u[:, 1:], u[:, :-1])) < bound  # along a row
    assert abs(_corr(u[1:], u[:-1])) < bound  # along a column
    # seeds one bit apart (either word): unrelated streams, not shifted copies of one another
    for other in (4, 7, 5 + (1 << 32)):
        v = CounterNoise(other).uniform(shape)
        assert abs(_corr(u, v)) < bound, other
        assert abs(_corr(u[:, 1:], v[:, :-1])) < bound, other
        assert (u == v).float().mean() < 1e-3
    # successive draws from one generator give different seeds
    g = torch.Generator().manual_seed(0)
    assert draw_seed(g) != draw_seed(g)


def test_noise_values_are_pinned():
    # The formula is part of a run's reproducibility (resumed runs, TP=N against TP=1): any change
    # to it must be deliberate.
    u = CounterNoise(0x0123456789ABCDEF).uniform((2, 3))
    bits = (u * 2**24).long().tolist()
    assert bits == PINNED, bits


PINNED = [[3357365, 13644684, 4845416], [14058342, 3860327, 1074107]]  # also by a pure-Python lowbias32


def test_shard_columns_are_the_full_tensors():
    full = CounterNoise(99).uniform((24, 64))
    shard = CounterNoise(99, col_offset=32).uniform((24, 32))
    assert torch.equal(shard, full[:, 32:])
    # the leading dims are flattened into rows, as the quantizer's 2D view
    assert torch.equal(CounterNoise(99).uniform((4, 6, 64)).reshape(24, 64), full)


@pytest.mark.compat
@pytest.mark.parametrize("shape", [(64, 96), (50, 40), (7, 3, 48)])
@pytest.mark.parametrize("role", SR_ROLES, ids=lambda r: r.value)
def test_kernel_eager_and_reference_draw_the_same_noise(shape, role):
    # Whole blocks and partial ones (padding draws no noise), the Hadamard path's transposed
    # layout, a shard's column offset: the kernel's noise is the reference's, bit for bit.
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    for noise in (CounterNoise(123456789012345), CounterNoise(2**63 + 5, col_offset=48)):
        ref = quantize_for_role(x, NVFP4, role, reference=True, noise=noise)
        # the counter noise materialized as a tensor gives the same result
        assert torch.equal(ref, quantize_for_role(x, NVFP4, role, reference=True,
                                                  noise=noise.uniform(x.shape)))
        fast = quantize_for_role(x, NVFP4, role, noise=noise)
        with eager_cpu_path():
            eager = quantize_for_role(x, NVFP4, role, noise=noise)
        assert torch.equal(ref.view(torch.int32), fast.view(torch.int32))
        assert torch.equal(ref.view(torch.int32), eager.view(torch.int32))


@pytest.mark.parametrize("stride", [1, 2])
def test_a_shard_draws_the_whole_tensors_noise_at_its_columns(stride):
    from snip_megatron.stats.noise import shard_indices

    seed, world, shape = 2**33 + 5, 2, (6, 64)
    whole = CounterNoise(seed).uniform(shape)
    for rank in range(world):
        local = shard_noise(seed, (6, 64 // world), rank=rank, world=world, stride=stride)
        if stride == 1:  # contiguous columns: the kernel's counter form, offset to the shard
            assert local == CounterNoise(seed, col_offset=rank * 32)
            local = local.uniform((6, 32))
        assert torch.equal(local, whole[:, shard_indices(64, rank, world, stride)])


@pytest.mark.parametrize("seed", [0, 2**63 + 12345, 2**64 - 1])
@pytest.mark.parametrize("col_offset", [0, 2**31 - 7, 2**32 - 1000])
def test_the_int32_element_path_is_the_uint32_formula(seed, col_offset):
    # uniform() mixes elements in int32 (wrapping products, masked shifts); the formula in int64,
    # element by element, is the reference. Offsets near 2**31 and 2**32 cross the sign bit; 1000
    # columns leave a scalar tail beside the vectorised loop.
    from snip_megatron.formats.sr_noise import _GOLDEN, _mix

    noise = CounterNoise(seed, col_offset=col_offset)
    r = torch.arange(7, dtype=torch.int64)
    k0 = _mix(_mix(r ^ (seed & 0xFFFFFFFF)) ^ (seed >> 32))
    k1 = _mix(k0 ^ _GOLDEN)
    c = torch.arange(col_offset, col_offset + 1000, dtype=torch.int64)
    want = (_mix(_mix(c[None, :] ^ k0[:, None]) ^ k1[:, None]) >> 8).to(torch.float32) * 2.0**-24
    assert torch.equal(noise.uniform((7, 1000)), want)


def test_seed_stream_is_a_function_of_seed_and_count():
    a, b, c = SeedStream(7), SeedStream(7), SeedStream(8)
    first = [draw_seed(a) for _ in range(4)]
    assert first == [b.next_seed() for _ in range(4)] and a.drawn == 4
    assert len(set(first)) == 4 and not set(first) & {c.next_seed() for _ in range(4)}
    assert all(0 <= s < 2**64 for s in first)
    assert [SeedStream(7).next_seed(), SeedStream(7).next_seed()] == first[:1] * 2  # a new stream restarts


class _DeviceGenerator:
    """Stands for a torch.Generator on a GPU: its seed is known on the host; drawing from it
    (what would wait for the device) fails."""

    device = torch.device("cuda")

    def __init__(self, seed):
        self.seed = seed

    def initial_seed(self):
        return self.seed

    def __getattr__(self, name):
        raise AssertionError(f"draw_seed used the device generator's {name}")


def test_a_device_generator_draws_from_its_host_twin():
    device, host = _DeviceGenerator(5), torch.Generator().manual_seed(5)
    assert [draw_seed(device) for _ in range(3)] == [draw_seed(host) for _ in range(3)]
    device.seed = 6  # re-seeded (manual_seed): the twin restarts from the new seed
    assert draw_seed(device) == draw_seed(torch.Generator().manual_seed(6))
