"""The emulated GEMM C = A @ B^T over quantized operands, in one of two ways with the same products:

- "tensor_core": the operands as `formats/operand.py` makes them (BF16 values that hold every
  quantized value exactly, FP32 scales apart), a BF16 GEMM with FP32 accumulation and FP32 output,
  then the per-tensor scales on the FP32 result; with FP32 block scales along K (blockwise FP8), one
  such GEMM per K block, each partial product scaled by its two blocks' scales and summed in FP32.
  On CUDA this runs on the tensor cores (`torch.mm(..., out_dtype=torch.float32)`); elsewhere the
  BF16 values are multiplied as FP32 (their products are exact in FP32 either way).
- "fp32": the dequantized FP32 operands, multiplied in FP32 at "highest" precision.

Both accumulate exact products in FP32, so they differ by summation order and by the rounding of
the scale products only (tests/emulation/test_gemm.py holds them to that bound, per recipe).
Which one runs: `QuantRuntime.gemm`, else `SNIP_EMULATED_GEMM` (tensor_core | fp32), else the
device's default (`DEFAULT_PATH`, and `DEFAULT_KBLOCK_PATH` for operands with FP32 block scales),
the faster where measured (bench/gpu/linear_timing.py).
"""

from __future__ import annotations

import logging
import os

import torch

from snip_megatron.formats.operand import GemmOperand

PATHS = ("tensor_core", "fp32")
DEFAULT_PATH = {"cuda": "tensor_core", "cpu": "fp32"}
"""Per device type, the faster path where it was measured. CPU (2 AVX-512 cores): "fp32", as
torch has no CPU GEMM from BF16 to an FP32 result, so the tensor-core path multiplies the same
FP32 numbers and adds the K-block loop and conversions (figures in docs/method.md). CUDA: the
tensor cores against CUDA-core FP32, ~790 against ~60 TFLOP/s on an H100 (bench/gpu/run_all.sh
measures it); any other device runs "fp32"."""
DEFAULT_KBLOCK_PATH = {"cuda": "tensor_core", "cpu": "fp32"}
"""The same for a GEMM whose operands carry FP32 block scales along K (blockwise FP8's default):
the tensor-core path runs one GEMM per 128-wide K block and scales each FP32 partial product, so
it moves K/128 partial results through memory; on a GPU it is expected to beat CUDA-core FP32
(estimate, not measured: linear_timing.py's "fp8" line says which is faster)."""
KBLOCK_GROUP_BYTES = 1 << 28
"""FP32 partial products computed by one batched GEMM of the K-block path (bounds its memory)."""

_LOG = logging.getLogger(__name__)
_NO_OUT_DTYPE: set = set()  # device types whose torch.mm has no out_dtype (logged once)


def gemm_path(device: torch.device, requested: "str | None" = None, kblock: bool = False) -> str:
    """The path a GEMM on `device` runs: `requested`, else SNIP_EMULATED_GEMM, else the default
    (`kblock`: its operands carry FP32 block scales along K)."""
    default = (DEFAULT_KBLOCK_PATH if kblock else DEFAULT_PATH).get(device.type, "fp32")
    path = requested or os.environ.get("SNIP_EMULATED_GEMM") or default
    if path not in PATHS:
        raise ValueError(f"emulated GEMM path {path!r} (QuantRuntime.gemm or SNIP_EMULATED_GEMM): "
                         f"choose one of {', '.join(PATHS)}")
    return path


def fp32_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a @ b_t in FP32 at "highest" precision: TF32 (which Megatron may enable) would round the
    dequantized values again."""
    previous = torch.get_float32_matmul_precision()
    if previous != "highest":
        torch.set_float32_matmul_precision("highest")
    try:
        return torch.matmul(a.float(), b_t.float())
    finally:
        if previous != "highest":
            torch.set_float32_matmul_precision(previous)


def tensor_core_mm(a: GemmOperand, b: GemmOperand) -> torch.Tensor:
    """a.values @ b.values^T with every scale applied, FP32, (rows of a, rows of b)."""
    if (a.block_scales is None) != (b.block_scales is None):
        raise ValueError("tensor_core_mm: both operands carry FP32 block scales along K, or neither")
    if a.block_scales is None:
        out = _bf16_mm(a.values, b.values.t())
    else:
        out = _kblock_mm(a, b)
    for scale in (a.tensor_scale, b.tensor_scale):  # one at a time: their product could underflow
        if scale is not None:
            out.mul_(scale)
    return out


def _kblock_mm(a: GemmOperand, b: GemmOperand) -> torch.Tensor:
    """Sum over K blocks of (A_k @ B_k^T) x a's block scale (per row) x b's (per column), in FP32,
    a group of K blocks per batched GEMM."""
    bk = a.block[1]
    if b.block[1] != bk:
        raise ValueError(f"tensor_core_mm: K blocks differ ({a.block} against {b.block})")
    sa, sb = _per_row(a), _per_row(b)  # (rows, K blocks)
    (rows_a, k), rows_b, nkb = a.values.shape, b.values.shape[0], sa.shape[1]
    av, bv = a.values, b.values
    if k % bk:  # a partial last block: zeros complete it (they add nothing)
        av, bv = (torch.nn.functional.pad(v, (0, nkb * bk - k)) for v in (av, bv))
    group = max(1, KBLOCK_GROUP_BYTES // (4 * rows_a * rows_b))
    out = None
    for k0 in range(0, nkb, group):
        k1 = min(nkb, k0 + group)
        ab = av[:, k0 * bk:k1 * bk].reshape(rows_a, k1 - k0, bk).transpose(0, 1)
        bb = bv[:, k0 * bk:k1 * bk].reshape(rows_b, k1 - k0, bk).permute(1, 2, 0)
        part = _bf16_mm(ab, bb)  # (blocks, rows_a, rows_b)
        part.mul_(sa[:, k0:k1].t()[:, :, None]).mul_(sb[:, k0:k1].t()[:, None, :])
        part = part[0] if k1 - k0 == 1 else part.sum(0)
        out = part if out is None else out.add_(part)
    return out


def _per_row(op: GemmOperand) -> torch.Tensor:
    """The operand's block scales, one row per row of its values: (rows, K blocks)."""
    br = op.block[0]
    scales = op.block_scales if br == 1 else op.block_scales.repeat_interleave(br, dim=0)
    return scales[:op.values.shape[0]]


def _bf16_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (2D or batched 3D) of BF16 values with an FP32 result. On CUDA the BF16 GEMM with
    FP32 output (cuBLAS, FP32 accumulation); elsewhere, or on a torch without out_dtype, the same
    values as FP32 (a product of two BF16 values is exact in FP32)."""
    if a.device.type == "cuda" and "cuda" not in _NO_OUT_DTYPE:
        mm = torch.mm if a.dim() == 2 else torch.bmm
        try:
            return mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError) as e:
            _NO_OUT_DTYPE.add("cuda")
            _LOG.warning("snip: torch.mm has no out_dtype here (%s: %s): the tensor-core path "
                         "multiplies its BF16 operands in FP32", type(e).__name__, e)
    return fp32_mm(a, b)
