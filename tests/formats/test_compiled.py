"""The compiled cast (formats/compiled.py): Inductor's graph of the fused path's arithmetic equals the
reference bit for bit, here on CPU (Inductor's C++ code; on a GPU it emits Triton, checked by
bench/gpu/compiled_cast_check.py), and its first-call check sends a key that differs or fails to the
eager path."""

import logging

import pytest
import torch

import snip_megatron.formats.cpu_kernel as cpu_kernel
from snip_megatron.formats import Role, compiled, quantize, quantize_reference
from snip_megatron.formats.spec import Rounding
from tests.formats.test_fused import CASE_DATA, SPECS, _assert_bits_equal


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """The compiled path for CPU tensors (it serves GPUs only), the C++ kernel off."""
    monkeypatch.setattr(cpu_kernel, "USE_CPU_KERNEL", False)
    monkeypatch.setattr(compiled, "serves", lambda x, want_codes, amax_group: not want_codes)
    compiled.reset()
    yield
    compiled.reset()


# One key each: per-tensor and 1x16 NVFP4 (E4M3 scales), 16x16 weight tiles (BF16), the Hadamard
# role with stochastic rounding (BF16), 1x32 MXFP4 (E8M0), 128x128 FP8 blocks with pow2 scales,
# tensorwise FP8.
KEYS = [("nvfp4", Role.FPROP_INPUT), ("nvfp4", Role.FPROP_WEIGHT), ("nvfp4", Role.WGRAD_GRAD_OUTPUT),
        ("mxfp4", Role.FPROP_INPUT), ("blockwise_pow2", Role.FPROP_WEIGHT), ("tensorwise", Role.FPROP_INPUT)]
# Ties, subnormal scales, zero blocks, an outlier, padding, NaN/Inf/-0; the BF16 keys: BF16 data.
FLOAT32_CASES = ["magnitudes", "ties", "outlier", "zero_blocks", "subnormal_scales", "pow2_data",
                 "odd_shape", "non_finite", "inf_only"]
BF16_CASES = ["bf16", "weight_bf16", "activation_sbh"]


@pytest.mark.parametrize("spec_name,role", KEYS, ids=[f"{s}-{r.value}" for s, r in KEYS])
def test_compiled_cast_equals_the_reference(spec_name, role, compiled_on_cpu):
    cast = SPECS[spec_name].cast(role)
    bf16 = role in (Role.FPROP_WEIGHT, Role.WGRAD_GRAD_OUTPUT) and spec_name == "nvfp4"
    for case in BF16_CASES if bf16 else FLOAT32_CASES:
        x = CASE_DATA[case]
        noise = None
        if cast.rounding is Rounding.STOCHASTIC:
            noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(3))
        want = quantize_reference(x, cast, dim=role.contraction_dim, noise=noise)
        for call in ("checked", "compiled alone"):
            got = quantize(x, cast, dim=role.contraction_dim, noise=noise)
            _assert_bits_equal(want, got, f"{spec_name} {role.value} {case} ({call})")
    assert set(compiled._VERDICT.values()) == {True}  # compiled, checked, and used


def test_a_key_whose_graph_differs_runs_eager_from_then_on(compiled_on_cpu, monkeypatch, caplog):
    calls = []

    def one_ulp_off(x, u, cast, block, out_dtype):
        calls.append(1)
        out = compiled._cast_graph(x, u, cast, block, out_dtype)
        return (out.view(torch.int32) + 1).view(torch.float32)

    monkeypatch.setattr(compiled, "_compiled", lambda key: one_ulp_off)
    x, cast = CASE_DATA["magnitudes"], SPECS["nvfp4"].cast(Role.FPROP_INPUT)
    want = quantize_reference(x, cast)
    with caplog.at_level(logging.WARNING):
        _assert_bits_equal(want, quantize(x, cast), "first call")
        _assert_bits_equal(want, quantize(x, cast), "second call")
    assert len(calls) == 1  # checked once, then never asked again
    assert list(compiled._VERDICT.values()) == [False]
    assert "differs from the eager path" in caplog.text


def test_a_key_that_fails_to_compile_runs_eager(compiled_on_cpu, monkeypatch, caplog):
    def broken(x, u, cast, block, out_dtype):
        raise RuntimeError("codegen failed")

    monkeypatch.setattr(compiled, "_compiled", lambda key: broken)
    x, cast = CASE_DATA["non_finite"], SPECS["mxfp4"].cast(Role.FPROP_INPUT)
    with caplog.at_level(logging.WARNING):
        _assert_bits_equal(quantize_reference(x, cast), quantize(x, cast), "mxfp4")
    assert list(compiled._VERDICT.values()) == [False]
    assert "RuntimeError: codegen failed" in caplog.text


def test_off_unless_asked_and_never_on_cpu(monkeypatch):
    x = torch.zeros(4, 32)
    monkeypatch.delenv("SNIP_COMPILED_CAST", raising=False)
    assert not compiled.enabled()
    monkeypatch.setenv("SNIP_COMPILED_CAST", "1")
    assert compiled.enabled()
    assert not compiled.serves(x, False, None)  # CPU: the C++ kernel or the eager path
    assert not compiled.serves(x.to("meta"), True, None)  # codes: the eager path
    assert compiled.serves(x.to("meta"), False, None)
