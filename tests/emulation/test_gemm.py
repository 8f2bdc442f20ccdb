"""The two emulated GEMM paths (emulation/gemm.py) agree to the accumulation-order bound, per recipe
and per GEMM of a linear; the tensor-core path is what a quantized linear runs when asked, and it
keeps its quantized weight in BF16.

The bound: both paths sum the same exact products in FP32; they differ by the order of the sums
(each within gamma_K = K u of the exact sum, u = 2**-24, relative to the sum of |products|), the
rounding of the scale products (a few u) and, for NVFP4's Hadamard roles, the FP32 path's inverse
transform of each operand. So |C_tc - C_fp32| <= (2 K + 32) u M, with M the sum of |products| of
either path's operands (float64). A scale off by 2**-10 breaks it (tested)."""

import sys

import pytest
import torch

from snip_megatron.emulation import QuantRuntime, quantized_linear
from snip_megatron.emulation.gemm import PATHS, fp32_mm, gemm_path, tensor_core_mm
from snip_megatron.formats import Role, quantize_for_role
from snip_megatron.formats.operand import quantize_operand
from snip_megatron.formats.sr_noise import CounterNoise, SeedStream
from tests.formats.test_fused import SPECS

U = 2.0**-24
# (A role, B role) of each GEMM, written C = A @ B^T in the GEMM layout
GEMMS = {"fprop": (Role.FPROP_INPUT, Role.FPROP_WEIGHT), "dgrad": (Role.DGRAD_GRAD_OUTPUT, Role.DGRAD_WEIGHT),
         "wgrad": (Role.WGRAD_GRAD_OUTPUT, Role.WGRAD_INPUT)}


def _tensors(n=192, k=320, m=200, seed=0):
    """X [n, k], W [m, k], G_Y [n, m]; k and m are not whole 128 blocks (a partial K block)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.logspace(-1, 1, k)
    w = torch.randn(m, k, generator=g) / k**0.5
    gy = torch.randn(n, m, generator=g) * 1e-3
    return {"input": x, "weight": w, "grad_output": gy}


def _both_paths(spec, gemm, tensors):
    """(C on the tensor-core path, C on the FP32 path, M) for one GEMM of `spec`."""
    ops, deqs = [], []
    for role in GEMMS[gemm]:
        t, noise = tensors[role.operand], CounterNoise(99)
        ops.append(quantize_operand(t, spec.cast(role), dim=role.contraction_dim, noise=noise))
        deq = quantize_for_role(t, spec, role, out_dtype=torch.float32, noise=noise)
        deqs.append(deq if role.contraction_dim == -1 else deq.t())
    c_tc, c_fp = tensor_core_mm(*ops), fp32_mm(deqs[0], deqs[1].t())
    magnitude = deqs[0].double().abs() @ deqs[1].double().abs().t()
    scaled = [_scaled(op).abs() for op in ops]
    magnitude += scaled[0] @ scaled[1].t()
    k = max(d.shape[1] for d in deqs + [op.values for op in ops])
    return c_tc, c_fp, (2 * k + 32) * U * magnitude


def _scaled(op):
    v = op.values.double()
    if op.block_scales is not None:
        br, bk = op.block
        v = v * op.block_scales.double().repeat_interleave(br, 0).repeat_interleave(bk, 1)[:v.shape[0], :v.shape[1]]
    return v if op.tensor_scale is None else v * float(op.tensor_scale)


@pytest.mark.parametrize("name", list(SPECS))
def test_paths_agree_to_the_accumulation_bound(name):
    spec, tensors = SPECS[name], _tensors()
    for gemm in GEMMS:
        c_tc, c_fp, bound = _both_paths(spec, gemm, tensors)
        assert c_tc.dtype == c_fp.dtype == torch.float32 and c_tc.shape == c_fp.shape, (name, gemm)
        excess = ((c_tc.double() - c_fp.double()).abs() - bound).max()
        assert excess <= 0, (name, gemm, float(excess))


@pytest.mark.parametrize("name", ["blockwise", "tensorwise", "nvfp4"])
def test_a_wrong_scale_breaks_the_bound(name):
    # The bound is tight enough to catch a scale off by 2**-10 (so the test above could fail).
    spec, tensors = SPECS[name], _tensors()
    roles = GEMMS["fprop"]
    ops = [quantize_operand(tensors[r.operand], spec.cast(r), dim=r.contraction_dim) for r in roles]
    op = ops[0]
    if op.block_scales is not None:
        ops[0] = op._replace(block_scales=op.block_scales * (1 + 2.0**-10))
    else:
        ops[0] = op._replace(tensor_scale=op.tensor_scale * (1 + 2.0**-10))
    _, c_fp, bound = _both_paths(spec, "fprop", tensors)
    assert ((tensor_core_mm(*ops).double() - c_fp.double()).abs() > bound).any()


@pytest.mark.parametrize("name", ["blockwise", "blockwise_pow2", "tensorwise", "mxfp8", "nvfp4", "mxfp4"])
def test_linear_on_either_path(name, monkeypatch):
    ql = sys.modules["snip_megatron.emulation.quantized_linear"]  # the module, not the function
    calls = []
    real = ql.tensor_core_mm
    monkeypatch.setattr(ql, "tensor_core_mm", lambda a, b: calls.append(1) or real(a, b))
    t = _tensors(n=64, k=256, m=128)
    outs = {}
    for path in PATHS:
        x, w = t["input"].clone().requires_grad_(), t["weight"].clone().requires_grad_()
        y = quantized_linear(x, w, None, SPECS[name], QuantRuntime(generator=SeedStream(5), gemm=path))
        y.backward(t["grad_output"])
        outs[path] = (y.detach(), x.grad, w.grad)
    assert len(calls) == 3  # the three GEMMs of the tensor-core run
    for what, a, b in zip(("Y", "G_X", "G_W"), outs["tensor_core"], outs["fp32"]):
        rel = float((a - b).norm() / b.norm())
        assert 0 <= rel < 1e-5, (name, what, rel)


def test_tensor_core_path_keeps_its_weight_in_bf16():
    saved = []

    def pack(t):
        saved.append(t.dtype)
        return t

    t = _tensors(n=32, k=128, m=64)
    x, w = t["input"].requires_grad_(), t["weight"].requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        quantized_linear(x, w, None, SPECS["nvfp4"], QuantRuntime(generator=SeedStream(1), gemm="tensor_core"))
    # X (high precision, re-quantized for wgrad), W, and fprop's quantized W for dgrad in BF16
    assert saved == [torch.float32, torch.float32, torch.bfloat16]


def test_path_choice(monkeypatch):
    monkeypatch.delenv("SNIP_EMULATED_GEMM", raising=False)
    assert gemm_path(torch.device("cpu")) == "fp32" and gemm_path(torch.device("cuda")) == "tensor_core"
    assert gemm_path(torch.device("cpu"), "tensor_core") == "tensor_core"
    monkeypatch.setenv("SNIP_EMULATED_GEMM", "tensor_core")
    assert gemm_path(torch.device("cpu")) == "tensor_core"
    assert gemm_path(torch.device("cpu"), "fp32") == "fp32"
    import snip_megatron.emulation.gemm as gemm

    monkeypatch.setitem(gemm.DEFAULT_KBLOCK_PATH, "cuda", "fp32")  # as a measurement could set it
    monkeypatch.delenv("SNIP_EMULATED_GEMM")
    assert gemm_path(torch.device("cuda"), kblock=True) == "fp32" and gemm_path(torch.device("cuda")) == "tensor_core"
    monkeypatch.setenv("SNIP_EMULATED_GEMM", "tf32")
    with pytest.raises(ValueError, match="tensor_core, fp32"):
        gemm_path(torch.device("cpu"))
