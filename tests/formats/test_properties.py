"""Properties of the quantizers that have no external oracle."""

import pytest
import torch

from snip_megatron.formats import (
    CastConfig, ElementFormat, Formats, FormatSpec, Role, hadamard_last_dim, hadamard_matrix,
    quantization_error, quantize, quantize_for_role,
)
from snip_megatron.formats.elements import cast_fp8, e2m1_codes, round_e2m1

NV = FormatSpec.for_precision("fp4")
SPECS = {name: FormatSpec.for_precision(p, **kw) for name, p, kw in [
    ("blockwise", "fp8", {}), ("tensorwise", "fp8", {"fp8_recipe": "tensorwise"}),
    ("mxfp8", "fp8", {"fp8_recipe": "mxfp8"}), ("nvfp4", "fp4", {}),
    ("mxfp4", "fp4", {"fp4_recipe": "mxfp4"})]}


@pytest.mark.parametrize("element,dtype", [(ElementFormat.E4M3, torch.float8_e4m3fn),
                                           (ElementFormat.E5M2, torch.float8_e5m2)])
def test_fp8_cast_is_torch_cast_after_saturation(element, dtype):
    y = torch.randn(4096) * torch.logspace(-12, 6, 4096)
    y[:4] = torch.tensor([1e9, -1e9, element.max * 1.01, -element.max * 1.5])
    codes = cast_fp8(y, element)
    m = torch.finfo(dtype).max
    assert torch.equal(codes.view(torch.uint8), y.clamp(-m, m).to(dtype).view(torch.uint8))
    assert torch.equal(codes[:4].float(), torch.tensor([m, -m, m, -m]))  # saturates, no NaN/inf


def test_fp8_blockwise_equals_manual_reference():
    x = torch.randn(8, 256) * torch.logspace(-4, 4, 256)
    q = quantize(x, SPECS["blockwise"].fprop_input, out_dtype=torch.float32)
    xb = x.view(8, 2, 128)
    amax = xb.abs().amax(-1, keepdim=True)
    scale = torch.full_like(amax, 448.0) / amax  # max / amax correctly rounded, as TE divides (__fdiv_rn)
    ref = (xb * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale.reciprocal()
    assert torch.equal(q, ref.view(8, 256))


def test_fp8_tensorwise_one_scale():
    x = torch.randn(16, 48)
    qt = quantize(x, SPECS["tensorwise"].dgrad_grad_output, return_codes=True, out_dtype=torch.float32)
    amax = x.abs().amax()
    scale = torch.full_like(amax, 57344.0) / amax  # correctly rounded, as TE divides
    assert qt.codes.dtype == torch.float8_e5m2 and qt.scales.shape == (1, 1)
    assert torch.equal(qt.dequantized, (x * scale).to(torch.float8_e5m2).float() * scale.reciprocal())


def test_e2m1_rounding_grid_and_codes():
    y = torch.tensor([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, -0.25, -5.0, -9.0])
    q = round_e2m1(y)
    assert q.tolist() == [0, 0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, -0.0, -4, -6]
    assert e2m1_codes(torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -6, -0.0])).tolist() == \
        [0, 1, 2, 3, 4, 5, 6, 7, 15, 8]


def test_stochastic_rounding_unbiased_and_reproducible():
    # Values strictly inside the grid (no saturation): E[Q(y)] = y. Mean error over 4096 seeds
    # per value; the standard error is <= step / 2 / sqrt(4096) = 1/128 step, so 0.03 step is > 3.8
    # standard errors. The rounding-to-nearest error at these values is up to 0.5 step.
    y = torch.tensor([0.1, 0.3, 0.6, 1.2, 1.9, 2.2, 2.7, 3.3, 4.4, 5.1, 5.9]).repeat(4096, 1)
    g = torch.Generator().manual_seed(123)
    u = torch.rand(y.shape, generator=g)
    q = round_e2m1(y, u)
    step = torch.tensor([0.5] * 5 + [1.0] * 3 + [2.0] * 3)
    mean_err = (q - y).mean(0) / step
    assert mean_err.abs().max() < 0.03
    rne_err = (round_e2m1(y[0]) - y[0]).abs() / step
    assert rne_err.max() > 0.3  # RNE would be biased at these values
    # The quantizer draws its noise from the generator it is given: same seed, same result.
    x = torch.randn(64, 64)
    cast = NV.dgrad_grad_output
    a = quantize(x, cast, generator=torch.Generator().manual_seed(7))
    b = quantize(x, cast, generator=torch.Generator().manual_seed(7))
    c = quantize(x, cast, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_stochastic_rounding_leaves_global_rng_alone():
    x = torch.randn(32, 32)
    state = torch.get_rng_state()
    quantize(x, NV.dgrad_grad_output, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), state)


def test_stochastic_rounding_needs_random_bits():
    with pytest.raises(ValueError, match="generator"):
        quantize(torch.randn(4, 16), NV.dgrad_grad_output)


def test_hadamard_orthogonal_and_pair_keeps_wgrad_product():
    m = hadamard_matrix(16, dtype=torch.float64)
    assert torch.allclose(m @ m.t(), torch.eye(16, dtype=torch.float64), atol=1e-15)
    assert set(m.abs().unique().tolist()) == {0.25}
    gy = torch.randn(64, 24, dtype=torch.float64)  # n x m
    x = torch.randn(64, 40, dtype=torch.float64)   # n x k
    ht = lambda t: hadamard_last_dim(t.t(), 16).t()  # along tokens
    assert torch.allclose(ht(gy).t() @ ht(x), gy.t() @ x, rtol=0, atol=1e-12)
    assert not torch.allclose(ht(x), x)


def test_hadamard_roles_return_the_original_domain():
    # Q = H^T Q(H x): codes live in the transformed domain, the dequantized tensor approximates x.
    x = torch.randn(64, 48)
    qt = quantize(x, NV.wgrad_input, dim=0, return_codes=True)
    rel = (qt.dequantized - x).norm() / x.norm()
    assert 0.01 < rel < 0.2
    assert qt.codes.shape == (48, 64)  # GEMM layout: tokens (the contraction dim) last


def test_weight_16x16_commutes_with_transpose():
    w = torch.randn(96, 160) * torch.logspace(-3, 3, 160)
    q = quantize(w, NV.fprop_weight, dim=-1)
    qt = quantize(w.t().contiguous(), NV.fprop_weight, dim=-1).t()
    assert torch.equal(q, qt)
    assert torch.equal(quantize_for_role(w, NV, Role.DGRAD_WEIGHT), q)


@pytest.mark.parametrize("name", list(SPECS))
def test_nan_inf_poison_their_scaling_group(name):
    spec = SPECS[name]
    x = torch.randn(256, 512)
    x[5, 3] = float("nan")
    x[200, 400] = float("inf")
    g = torch.Generator().manual_seed(0)
    for role in Role:
        q = quantize_for_role(x, spec, role, generator=g)
        nonfinite = ~torch.isfinite(q)
        # Rule: never finite where the input was not, and NaN (not Inf) wherever it is poisoned.
        assert nonfinite[5, 3] and nonfinite[200, 400]
        assert torch.isnan(q[nonfinite]).all()
        cast = spec.cast(role)
        if cast.block is None or cast.tensor_scale:
            assert nonfinite.all()  # a per-tensor scale spreads it to the whole tensor
        else:
            assert 0 < nonfinite.float().mean() < 0.5  # only the blocks holding them


def test_all_zero_tensor_quantizes_to_zero():
    for spec in SPECS.values():
        for role in Role:
            q = quantize_for_role(torch.zeros(32, 64), spec, role, generator=torch.Generator())
            assert torch.equal(q, torch.zeros(32, 64))


def test_leading_dims_and_token_dim():
    x = torch.randn(8, 4, 32)  # [s, b, h]
    q3 = quantize(x, NV.wgrad_input, dim=0)
    q2 = quantize(x.reshape(32, 32), NV.wgrad_input, dim=0)
    assert q3.shape == x.shape and torch.equal(q3.reshape(32, 32), q2)
    with pytest.raises(ValueError, match="dim"):
        quantize(x, NV.fprop_input, dim=1)


def test_quantization_error_orders_precisions():
    x = torch.randn(256, 256)
    errs = {p: float(quantization_error(x, p, Role.FPROP_INPUT)) for p in ("bf16", "fp8", "fp4")}
    assert errs["bf16"] == 0.0 and 0 < errs["fp8"] < errs["fp4"]
    assert float(quantization_error(x, "fp4", "wgrad_grad_output", seed=3)) == \
        float(quantization_error(x, "fp4", "wgrad_grad_output", seed=3))
    nv = float(quantization_error(x, "fp4", "fprop_input"))
    mx = float(quantization_error(x, "fp4", "fprop_input", formats=Formats(fp4_recipe="mxfp4")))
    assert nv < mx  # finer blocks and E4M3 scales beat 1x32 power-of-two scales on Gaussian data


def test_bf16_output_dtype():
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    q = quantize(x, NV.fprop_input)
    assert q.dtype == torch.bfloat16
    assert quantize(x, None) is x or torch.equal(quantize(x, None), x)


def test_nvfp4_gradient_quantizer_is_unbiased_over_seeds():
    # Whole quantizer (scales included): the mean of Q(x) over 128 seeds approaches x, while the
    # deterministic (RNE) quantizer keeps its error. Standard error of the mean ~ step / 23.
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(42))
    cast = NV.dgrad_grad_output
    mean = torch.stack([quantize(x, cast, generator=torch.Generator().manual_seed(s))
                        for s in range(128)]).mean(0)
    sr_bias = (mean - x).norm() / x.norm()
    rne_err = (quantize(x, NV.fprop_input) - x).norm() / x.norm()
    assert sr_bias < 0.3 * rne_err, (sr_bias, rne_err)


def test_stochastic_rounding_never_leaves_the_grid():
    y = torch.tensor([6.0, -6.0, 5.999, 3.9999, 1.9999])
    u = torch.full_like(y, 1 - 2.0**-24)  # the largest U[0,1) float
    assert round_e2m1(y, u).tolist() == [6.0, -6.0, 6.0, 4.0, 2.0]
