"""The fused quantizer (`quantize`) against the eager reference (`quantize_reference`), bit for bit.

Every recipe and variant (FP8 blockwise with FP32 and power-of-two scales, E4M3 and HYBRID E5M2,
tensorwise, MXFP8; NVFP4 with its 2D weight tiles, RHT and stochastic or nearest gradients;
MXFP4), every GEMM role, on the data of the other numerics tests (torchao's cases: magnitudes,
rounding ties, outliers, zero blocks, subnormal scales, BF16; the power-of-two scale cases;
zeros, infinities and NaN; shapes that are not whole blocks; [s, b, h] activations), with one
chunk and with many. Equal means: the same dequantized bits (NaN where the reference has NaN),
codes and scales; codes inside a block holding a non-finite value, and the FP32/E4M3 scales of a
block holding a NaN, are the platform's NaN arithmetic in the reference and are not compared
(their dequantized values are NaN in both; E8M0 scales are compared everywhere)."""

import itertools
import os
import zlib

import pytest
import torch
import torch.nn.functional as F

import snip_megatron.formats.cpu_kernel as cpu_kernel
import snip_megatron.formats.fused as fused
import snip_megatron.formats.kernel_path as kernel_path
from snip_megatron.formats import (
    ElementFormat, Formats, Role, Rounding, hadamard_last_dim, quantize, quantize_for_role,
    quantize_reference,
)
from snip_megatron.formats.elements import cast_fp8, round_e2m1
from snip_megatron.formats.spec import ScaleFormat
from snip_megatron.formats.sr_noise import CounterNoise
from tests.formats.test_torchao_oracle import CASES, _magnitudes
from tests.formats.test_variants import _data as _pow2_data

FORMATS = {
    "blockwise": Formats(), "blockwise_pow2": Formats(fp8_block_scales="pow2"),
    "blockwise_hybrid": Formats(fp8_format="hybrid"),
    "blockwise_pow2_hybrid": Formats(fp8_format="hybrid", fp8_block_scales="pow2"),
    "tensorwise": Formats(fp8_recipe="tensorwise"),
    "tensorwise_e4m3": Formats(fp8_recipe="tensorwise", fp8_format="e4m3"),
    "mxfp8": Formats(fp8_recipe="mxfp8"),
}
SPECS = {name: f.spec("fp8") for name, f in FORMATS.items()}
SPECS["nvfp4"] = Formats().spec("fp4")
SPECS["nvfp4_nearest"] = Formats(fp4_gradient_rounding="nearest").spec("fp4")
SPECS["mxfp4"] = Formats(fp4_recipe="mxfp4").spec("fp4")


def _non_finite():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 512, generator=g)
    x[5, 3] = float("nan")
    x[200, 400] = float("inf")
    x[130, 7] = -float("inf")
    x[7] = 0.0
    x[9, 17] = -0.0
    x[10, :128] = -1e-30  # rounds to -0
    return x


def _inf_only():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    x[3, 40] = float("inf")
    x[50, 200] = -float("inf")
    return x


def _cases():
    cases = dict(CASES)
    cases["pow2_data"] = _pow2_data()
    cases["non_finite"] = _non_finite()
    cases["inf_only"] = _inf_only()
    cases["zeros"] = torch.zeros(32, 64)
    cases["odd_shape"] = _magnitudes(33, 50, lo=-3, hi=3, seed=2)
    cases["activation_sbh"] = _magnitudes(64, 384, lo=-2, hi=2, seed=3).reshape(16, 4, 384).bfloat16()
    cases["one_dim"] = _magnitudes(1, 200, lo=-2, hi=2, seed=6).reshape(200)
    cases["weight_bf16"] = (torch.randn(256, 384, generator=torch.Generator().manual_seed(7)) / 20).bfloat16()
    return cases


CASE_DATA = _cases()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_bits_equal(a, b, what, where=None):
    """Same dtype, shape and bits (NaN of any payload counts as equal NaN), where `where`."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    same = _bits(a) == _bits(b)
    if a.is_floating_point():
        nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
        same = (same & ~nan_a & ~nan_b) | (nan_a & nan_b)
    if where is not None:
        same = same | ~where
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {same.numel()} differ"


def _blocks_holding(x, cast, dim, test):
    """Per block of the GEMM layout (after padding and Hadamard, as the reference sees it):
    whether `test` holds for any element; and that mask per element."""
    from snip_megatron.formats.quantize import _gemm_layout

    xg, _ = _gemm_layout(x.float(), dim)
    br, bc = cast.block if cast.block is not None else xg.shape
    xg = F.pad(xg, (0, -xg.shape[1] % bc, 0, -xg.shape[0] % br))
    if cast.hadamard:
        xg = hadamard_last_dim(xg, cast.hadamard)
    rows, cols = xg.shape
    hit = test(xg).view(rows // br, br, cols // bc, bc).any(3).any(1)
    return hit, hit.repeat_interleave(br, 0).repeat_interleave(bc, 1)


def assert_same_quantization(x, cast, dim, **kwargs):
    ref = quantize_reference(x, cast, dim=dim, return_codes=True, **kwargs)
    fast = quantize(x, cast, dim=dim, return_codes=True, **kwargs)
    _assert_bits_equal(ref.dequantized, fast.dequantized, "dequantized")
    nan_blocks, _ = _blocks_holding(x, cast, dim, torch.isnan)
    _, nonfinite_elems = _blocks_holding(x, cast, dim, lambda t: ~torch.isfinite(t))
    _assert_bits_equal(ref.codes, fast.codes, "codes", where=~nonfinite_elems)
    scale_where = None if cast.scale is ScaleFormat.E8M0 or cast.block is None else ~nan_blocks
    _assert_bits_equal(ref.scales, fast.scales, "scales", where=scale_where)
    if ref.tensor_scale is None:
        assert fast.tensor_scale is None
    else:
        _assert_bits_equal(ref.tensor_scale, fast.tensor_scale, "tensor_scale")
    # Without codes the result is the same tensor (values and dtype).
    plain = quantize(x, cast, dim=dim, **kwargs)
    _assert_bits_equal(ref.dequantized, plain, "dequantized (no codes)")
    return ref


def _require_kernel() -> None:
    # The kernel must build wherever the tests run (CI has gcc and ninja); only an explicit
    # SNIP_CPU_KERNEL=0 (the eager path chosen) skips its cases.
    from snip_megatron.formats.cpu_kernel import kernel, unavailable_reason

    if os.environ.get("SNIP_CPU_KERNEL") == "0":
        pytest.skip("SNIP_CPU_KERNEL=0: the eager path was chosen")
    assert kernel() is not None, f"the CPU kernel did not build: {unavailable_reason()}"


@pytest.fixture(params=["kernel", "eager_many_chunks"])
def chunking(request, monkeypatch):
    # kernel: the compiled CPU quantizer (formats/cpu_kernel.py). eager: the eager fused path (the
    # CUDA path, there in one chunk, and the CPU fallback), in many chunks of a few rows each (at
    # least one block row), so every chunk boundary is crossed; one chunk runs the same ops.
    if request.param == "kernel":
        _require_kernel()
        monkeypatch.setattr(cpu_kernel, "USE_CPU_KERNEL", True)
    else:
        monkeypatch.setattr(cpu_kernel, "USE_CPU_KERNEL", False)
    if request.param == "eager_many_chunks":
        monkeypatch.setattr(fused, "CHUNK_ELEMENTS", 4096)
        monkeypatch.setattr(fused, "_KEPT", __import__("threading").local())
    return request.param


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("case", list(CASE_DATA))
def test_fused_equals_reference_every_role(case, spec_name, chunking):
    x, spec = CASE_DATA[case], SPECS[spec_name]
    for role in Role:
        cast = spec.cast(role)
        if cast.hadamard and x.dim() == 1:
            continue  # a 1D tensor has no token dim to transform along
        noise = None
        if cast.rounding is Rounding.STOCHASTIC:
            # counter-based, as the emulated linears draw it: the kernel's own noise (explicit
            # noise tensors: test_weight_and_activation_shapes_of_the_benchmarks)
            noise = CounterNoise(zlib.crc32(case.encode()), col_offset=16)
        for out_dtype in (None, torch.float32) if x.dtype != torch.float32 else (None,):
            assert_same_quantization(x, cast, role.contraction_dim, out_dtype=out_dtype, noise=noise)


@pytest.mark.parametrize("spec_name", ["nvfp4", "nvfp4_nearest", "blockwise_hybrid"])
def test_same_generator_same_bits(spec_name):
    # Drawn from a generator, the noise is the reference's draw: same seed, same result.
    spec = SPECS[spec_name]
    x = _magnitudes(64, 96, lo=-2, hi=2, seed=8)
    for role in Role:
        ref = quantize_for_role(x, spec, role, reference=True, generator=torch.Generator().manual_seed(3))
        fast = quantize_for_role(x, spec, role, generator=torch.Generator().manual_seed(3))
        _assert_bits_equal(ref, fast, role.value)


def _grid_probe(lo_exp: int, hi_exp: int) -> torch.Tensor:
    """Every float32 in [2**lo_exp, 2**hi_exp) whose low 12 mantissa bits are 0 (the grid points
    and the rounding ties of any format with <= 11 mantissa bits), 1 or all ones (their
    neighbours), with both signs; plus subnormal float32s."""
    exps = torch.arange(lo_exp + 127, hi_exp + 127, dtype=torch.int64)
    top = torch.arange(1 << 11, dtype=torch.int64) << 12
    low = torch.tensor([0, 1, (1 << 12) - 1], dtype=torch.int64)
    bits = (exps[:, None, None] << 23) | top[None, :, None] | low[None, None, :]
    bits = torch.cat([bits.reshape(-1), torch.tensor([1, 2, 3, (1 << 23) - 1, 1 << 22])])
    pos = bits.to(torch.int32).view(torch.float32)
    return torch.cat([pos, -pos, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])


@pytest.mark.parametrize("element", list(ElementFormat))
def test_element_rounding_equals_the_casts(element):
    # The magic-number rounding against torch's float8 casts (after saturation) and the
    # reference's E2M1 rounding, on every tie, its neighbours and every binade in range.
    y = _grid_probe(-30, 17)
    want = cast_fp8(y, element).float() if element is not ElementFormat.E2M1 else round_e2m1(y.clone())
    got = y.clone()
    scratch = fused._Scratch(y.numel(), y.device)
    fused._round_in_place(got, element, None, scratch, fused._constants(y.device))
    _assert_bits_equal(want, got, element.value)


@pytest.mark.compat
@pytest.mark.parametrize("element", list(ElementFormat))
def test_kernel_element_rounding_equals_the_casts(element):
    # The compiled kernel's rounding on the same probe: a per-tensor cast with scale 1, its grid
    # values (q) against torch's float8 casts and the reference's E2M1 rounding.
    from snip_megatron.formats.cpu_kernel import kernel

    _require_kernel()
    y = _grid_probe(-30, 17)
    want = cast_fp8(y, element).float() if element is not ElementFormat.E2M1 else round_e2m1(y.clone())
    x = y.view(1, -1)
    out, q = torch.empty_like(x), torch.empty_like(x)
    kernel().quantize_blocks(x, out, q, None, None, 1, x.shape[1], kernel_path.ELEMENT_CODES[element],
                             0, element.max, 1.0, 1.0, 1.0, 1.0, True)
    _assert_bits_equal(want, q.view(-1), element.value)
    _assert_bits_equal(want, out.view(-1), element.value)
    if element is ElementFormat.E2M1:  # stochastic, on the finite probe values
        finite = torch.isfinite(y)
        yf = y[finite].view(1, -1)
        g = torch.Generator().manual_seed(11)
        for u in (torch.rand(yf.shape, generator=g), torch.full(yf.shape, 1 - 2.0**-24)):
            out, q = torch.empty_like(yf), torch.empty_like(yf)
            kernel().quantize_blocks(yf, out, q, u, None, 1, yf.shape[1], 0, 0, 6.0, 1.0, 1.0,
                                     1.0, 1.0, True)
            _assert_bits_equal(round_e2m1(yf.clone(), u), q, "e2m1 sr")


def test_stochastic_rounding_equals_the_reference_bit_for_bit():
    y = _grid_probe(-8, 4)
    y = y[torch.isfinite(y)]
    g = torch.Generator().manual_seed(11)
    for u in (torch.rand(y.shape, generator=g), torch.full(y.shape, 1 - 2.0**-24), torch.zeros(y.shape)):
        want = round_e2m1(y.clone(), u)
        got = y.clone()
        scratch = fused._Scratch(y.numel(), y.device)
        fused._round_in_place(got, ElementFormat.E2M1, u, scratch, fused._constants(y.device))
        _assert_bits_equal(want, got, "e2m1 sr")


def test_weight_and_activation_shapes_of_the_benchmarks():
    # The shapes the training benchmarks quantize, each role of each default recipe, with chunks.
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(512, 704, generator=g) * 3).bfloat16()
    w = (torch.randn(704, 128, generator=g) / 10).bfloat16()
    for spec_name, role in itertools.product(("blockwise", "nvfp4", "mxfp4", "tensorwise"), Role):
        t = w if role.operand == "weight" else x
        cast = SPECS[spec_name].cast(role)
        noise = torch.rand(t.shape, generator=g) if cast.rounding is Rounding.STOCHASTIC else None
        assert_same_quantization(t, cast, role.contraction_dim, out_dtype=torch.float32, noise=noise)


def test_errors_are_the_references():
    cast = SPECS["nvfp4"].dgrad_grad_output
    for fn in (quantize, quantize_reference):
        with pytest.raises(ValueError, match="generator"):
            fn(torch.randn(4, 16), cast)
        with pytest.raises(ValueError, match="noise shape"):
            fn(torch.randn(4, 16), cast, noise=torch.rand(4, 8))
        with pytest.raises(ValueError, match="dim"):
            fn(torch.randn(4, 2, 16), SPECS["nvfp4"].fprop_input, dim=1)
