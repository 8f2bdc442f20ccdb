"""Token samples and ||G^T X||^2 estimated from one."""

import numpy as np
import torch

from snip_megatron.stats.tokens import TOKEN_CHUNK, WgradNormEstimate, chunk_grams, sample_rows, sum_sq


def test_sample_keeps_every_stride_th_chunk():
    for n, stride in ((256, 4), (250, 4), (100, 3), (64, 4), (40, 4), (500, 1)):
        s = sample_rows(n, stride)
        want = [r for r in range(n) if (r // TOKEN_CHUNK) % stride == 0] if n >= stride * TOKEN_CHUNK else list(range(n))
        got = list(range(n)) if s.rows is None else s.rows.tolist()
        assert got == want, (n, stride)
        assert s.kept == len(want) and abs(s.scale - n / len(want)) < 1e-12
        for row in (0, 5, 16, 33, 64, 100, n):  # count_below agrees with the indices
            assert s.count_below(row) == sum(1 for r in want if r < row), (n, stride, row)
    assert sample_rows(64, 4, min_chunks=2).rows is None  # one chunk only: keep every row


def test_chunk_grams_and_exact_norm_without_a_sample():
    g = torch.Generator().manual_seed(0)
    x, gy = torch.randn(100, 12, generator=g), torch.randn(100, 7, generator=g)
    grams = chunk_grams(x)
    assert grams.shape == (7, 16, 16)
    torch.testing.assert_close(grams[1], x[16:32] @ x[16:32].t())
    torch.testing.assert_close(grams[6, :4, :4], x[96:] @ x[96:].t())  # the zero-padded last chunk
    est = WgradNormEstimate(gy, x, sample_rows(100, 1))
    exact = sum_sq(gy.t() @ x)
    assert est.value(exact) is exact


def _estimates(gy, x, stride, orders=300):
    n = gy.shape[0]
    sample = sample_rows(n, stride, min_chunks=2)
    out = []
    for seed in range(orders):  # a random order of the chunks = a random sample of them
        order = torch.randperm(n // TOKEN_CHUNK, generator=torch.Generator().manual_seed(seed))
        rows = (order.view(-1, 1) * TOKEN_CHUNK + torch.arange(TOKEN_CHUNK)).reshape(-1)
        g2, x2 = gy[rows], x[rows]
        est = WgradNormEstimate(g2, x2, sample)
        out.append(float(est.value(sum_sq(sample.take(g2).t() @ sample.take(x2)))))
    return np.array(out)


def test_norm_from_a_sample_is_unbiased_over_chunk_orders():
    """A gradient with a shared direction (as a loss gradient has) and pure noise (the
    backward-noise pass): the mean estimate over random samples of chunks is the exact value; with
    a shared direction the estimate is also close on every sample."""
    gen = torch.Generator().manual_seed(1)
    n, m, k = 512, 24, 20
    u, v = torch.randn(m, generator=gen), torch.randn(k, generator=gen)
    noise_g, noise_x = torch.randn(n, m, generator=gen), torch.randn(n, k, generator=gen)
    a = 1 + 0.3 * torch.randn(n, 1, generator=gen)
    for gy, x, spread in ((a * u + noise_g, a * v + noise_x, 0.1), (noise_g, noise_x, None)):
        exact = float(sum_sq(gy.t() @ x))
        est = _estimates(gy, x, stride=4)
        assert abs(est.mean() - exact) < 3 * est.std() / np.sqrt(len(est)) + 1e-3 * exact, (est.mean(), exact)
        if spread is not None:
            assert est.std() < spread * exact, (est.std(), exact)
