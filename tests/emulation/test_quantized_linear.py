import sys

import pytest
import torch

from snip_megatron.emulation import QuantRuntime, quantized_linear
from snip_megatron.emulation.quantized_linear import shares_quantization
from snip_megatron.formats import FormatSpec, Role, quantize_for_role
from snip_megatron.formats.operand import quantize_operand
from snip_megatron.formats.sr_noise import CounterNoise, draw_seed

RECIPES = {"blockwise": ("fp8", {}), "tensorwise": ("fp8", {"fp8_recipe": "tensorwise"}),
           "mxfp8": ("fp8", {"fp8_recipe": "mxfp8"}), "nvfp4": ("fp4", {}),
           "mxfp4": ("fp4", {"fp4_recipe": "mxfp4"})}


def _spec(name):
    p, kw = RECIPES[name]
    return FormatSpec.for_precision(p, **kw)


def _data(dtype=torch.float32, n=(8, 4), k=256, m=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*n, k, generator=g).to(dtype)
    w = (torch.randn(m, k, generator=g) / k**0.5).to(dtype)
    gy = torch.randn(*n, m, generator=g).to(dtype)
    return x, w, gy


def _run(x, w, gy, spec, seed=5, bias=None, gemm="fp32"):
    # The FP32 GEMM path: its results are the FP32 products of the dequantized operands, bit for
    # bit (tests/emulation/test_gemm.py holds the tensor-core path to them).
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    y = quantized_linear(x, w, b, spec, QuantRuntime(generator=torch.Generator().manual_seed(seed), gemm=gemm))
    y.backward(gy)
    return y, x.grad, w.grad, (None if b is None else b.grad)


@pytest.mark.parametrize("name", list(RECIPES))
def test_matches_independent_computation(name):
    spec = _spec(name)
    x, w, gy = _data()
    y, gx, gw, _ = _run(x, w, gy, spec, seed=5)
    x2, gy2 = x.reshape(-1, 256), gy.reshape(-1, 128)
    q = lambda t, role, **kw: quantize_for_role(t, spec, role, out_dtype=torch.float32, **kw)  # noqa: E731
    # Stochastic rounding seeds dgrad's noise, then wgrad's, from the layer's generator.
    g = torch.Generator().manual_seed(5)
    u_dgrad, u_wgrad = CounterNoise(draw_seed(g)), CounterNoise(draw_seed(g))
    y_ref = q(x2, Role.FPROP_INPUT) @ q(w, Role.FPROP_WEIGHT).t()
    gx_ref = q(gy2, Role.DGRAD_GRAD_OUTPUT, noise=u_dgrad) @ q(w, Role.DGRAD_WEIGHT)
    gw_ref = q(gy2, Role.WGRAD_GRAD_OUTPUT, noise=u_wgrad).t() @ q(x2, Role.WGRAD_INPUT)
    assert torch.equal(y, y_ref.reshape(y.shape))
    assert torch.equal(gx, gx_ref.reshape(gx.shape))
    assert torch.equal(gw, gw_ref)


def test_bf16_is_the_plain_gemms():
    spec = FormatSpec.for_precision("bf16")
    x, w, gy = _data(torch.bfloat16)
    bias = torch.randn(128).bfloat16()
    y, gx, gw, gb = _run(x, w, gy, spec, bias=bias)
    x2, gy2 = x.reshape(-1, 256), gy.reshape(-1, 128)
    assert torch.equal(y.reshape(-1, 128), torch.matmul(x2, w.t()) + bias)
    assert torch.equal(gx.reshape(-1, 256), gy2.matmul(w))
    assert torch.equal(gw, gy2.t().matmul(x2))
    assert torch.equal(gb, gy2.sum(0))
    assert y.dtype == gx.dtype == gw.dtype == torch.bfloat16


def test_error_ordering_fp4_fp8_exact():
    x, w, gy = _data(seed=3)
    bf16 = FormatSpec.for_precision("bf16")  # no casts: float64 GEMMs
    exact = [t.detach() for t in _run(x.double(), w.double(), gy.double(), bf16)[:3]]
    rel = {}
    for name in ("blockwise", "nvfp4"):
        outs = [o.detach() for o in _run(x, w, gy, _spec(name))[:3]]
        rel[name] = [float((o.double() - e).norm() / e.norm()) for o, e in zip(outs, exact)]
    for i, what in enumerate(("Y", "G_X", "G_W")):
        assert 0 < rel["blockwise"][i] < rel["nvfp4"][i], (what, rel)


def test_dtypes_and_bias_in_fp32():
    spec = _spec("nvfp4")
    x, w, gy = _data(torch.bfloat16)
    bias = torch.randn(128).bfloat16()
    y, gx, gw, gb = _run(x, w, gy, spec, bias=bias)
    assert y.dtype == gx.dtype == gw.dtype == gb.dtype == torch.bfloat16
    # The bias is added to the FP32 product before the single rounding to BF16.
    def q(t, role):
        return quantize_for_role(t.reshape(-1, t.shape[-1]), spec, role, out_dtype=torch.float32)

    ref = (q(x, Role.FPROP_INPUT) @ q(w, Role.FPROP_WEIGHT).t() + bias.float()).bfloat16()
    assert torch.equal(y.reshape(-1, 128), ref)


def test_stochastic_rounding_needs_generator_and_is_seeded():
    spec = _spec("nvfp4")
    x, w, gy = _data()
    xr = x.clone().requires_grad_()
    y = quantized_linear(xr, w, None, spec, QuantRuntime())
    with pytest.raises(ValueError, match="generator"):
        y.backward(gy)
    a, b, c = (_run(x, w, gy, spec, seed=s)[1] for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_accumulate_into_main_grad():
    spec = _spec("blockwise")
    x, w, gy = _data()
    ref_gw = _run(x, w, gy, spec)[2]
    wp = torch.nn.Parameter(w.clone())
    wp.main_grad = torch.ones_like(w)
    wp.grad_added_to_main_grad = False
    y = quantized_linear(x, wp, None, spec, QuantRuntime(accumulate_into_main_grad=True, gemm="fp32"))
    y.backward(gy)
    assert torch.equal(wp.main_grad, 1 + ref_gw) and wp.grad_added_to_main_grad


def test_quantized_gemm_runs_at_highest_fp32_precision(monkeypatch):
    seen, real = [], torch.matmul

    def spy(a, b):
        seen.append(torch.get_float32_matmul_precision())
        return real(a, b)

    monkeypatch.setattr(torch, "matmul", spy)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 allowed, as Megatron configures GPUs
    try:
        _run(*_data(), _spec("nvfp4"))
        assert seen == ["highest"] * 3
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision(previous)


# Roles of one operand whose quantizations are the same values, per recipe: W's fprop and dgrad
# casts with one scale or square tiles; X's and G_Y's fprop/wgrad and dgrad/wgrad casts with one
# scale (tensorwise FP8).
SHARED = {"blockwise": {"weight"}, "tensorwise": {"weight", "grad_output", "input"}, "mxfp8": set(),
          "nvfp4": {"weight"}, "mxfp4": set()}


@pytest.mark.parametrize("name", list(RECIPES))
def test_shared_quantizations_follow_the_casts(name):
    spec = _spec(name)
    shared = {operand for operand, (a, b) in {
        "weight": (Role.FPROP_WEIGHT, Role.DGRAD_WEIGHT),
        "grad_output": (Role.DGRAD_GRAD_OUTPUT, Role.WGRAD_GRAD_OUTPUT),
        "input": (Role.FPROP_INPUT, Role.WGRAD_INPUT)}.items() if shares_quantization(spec, a, b)}
    assert shared == SHARED[name]


@pytest.mark.parametrize("gemm", ["fp32", "tensor_core"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_each_operand_is_quantized_once_per_distinct_cast(name, gemm, monkeypatch):
    spec = _spec(name)
    calls = []

    def counting(tensor, spec, role, **kw):
        calls.append(Role(role))
        return quantize_for_role(tensor, spec, role, **kw)

    def counting_operand(tensor, cast, *, dim, **kw):
        calls.append(next(r for r in Role if spec.cast(r) == cast and r.contraction_dim == dim
                          and r.operand == _operand_of(tensor, x, w)))
        return quantize_operand(tensor, cast, dim=dim, **kw)

    # the module, not the function the package exports under the same name
    module = sys.modules["snip_megatron.emulation.quantized_linear"]
    monkeypatch.setattr(module, "quantize_for_role", counting)
    monkeypatch.setattr(module, "quantize_operand", counting_operand)
    x, w, gy = _data()
    _run(x, w, gy, spec, gemm=gemm)
    expected = set(Role)
    if "weight" in SHARED[name]:
        expected.discard(Role.DGRAD_WEIGHT)
    if "grad_output" in SHARED[name]:
        expected.discard(Role.WGRAD_GRAD_OUTPUT)
    if "input" in SHARED[name]:
        expected.discard(Role.WGRAD_INPUT)
    assert sorted(calls) == sorted(expected)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("m", [200, 48])
def test_shared_quantizations_are_bit_exact_on_partial_tiles(name, m):
    # W [m, 256] with m not a multiple of the 128x128 (FP8) tiles: a partial tile row at the edge.
    spec = _spec(name)
    x, w, gy = _data(m=m, seed=3)
    y, gx, gw, _ = _run(x, w, gy, spec, seed=7)
    x2, gy2 = x.reshape(-1, 256), gy.reshape(-1, m)
    q = lambda t, role, **kw: quantize_for_role(t, spec, role, out_dtype=torch.float32, **kw)  # noqa: E731
    g = torch.Generator().manual_seed(7)
    u_dgrad, u_wgrad = CounterNoise(draw_seed(g)), CounterNoise(draw_seed(g))
    assert torch.equal(gx.reshape(-1, 256), q(gy2, Role.DGRAD_GRAD_OUTPUT, noise=u_dgrad) @ q(w, Role.DGRAD_WEIGHT))
    assert torch.equal(gw, q(gy2, Role.WGRAD_GRAD_OUTPUT, noise=u_wgrad).t() @ q(x2, Role.WGRAD_INPUT))
    assert torch.equal(y.reshape(-1, m), q(x2, Role.FPROP_INPUT) @ q(w, Role.FPROP_WEIGHT).t())


def _operand_of(tensor, x, w) -> str:
    """Which of the layer's tensors a quantized tensor is (by shape: X and G_Y differ in width)."""
    if tensor.shape == w.shape:
        return "weight"
    return "input" if tensor.shape[-1] == x.shape[-1] else "grad_output"
