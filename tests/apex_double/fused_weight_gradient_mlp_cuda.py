"""Test double of apex's CUDA extension `fused_weight_gradient_mlp_cuda`, for CPU tests only.

Megatron-Core's local linears (`tensor_parallel/layers.py`, megatron-core 0.16.1 and 0.19.2: the
import at module load sets `_grad_accum_fusion_available`; `ColumnParallelLinear` /
`RowParallelLinear` refuse `gradient_accumulation_fusion=True` without it, and
`LinearWithGradAccumulationAndAsyncCommunication.backward` calls it) accumulate the weight
gradient straight into `weight.main_grad` through this extension when gradient-accumulation
fusion is on, Megatron-LM's default. Apex cannot be built without CUDA, so tests that run
Megatron's local layers (the GPT output layer of a TE-spec model included) with that default put
`tests/apex_double` on sys.path before Megatron is imported. Never installed, never shipped.

Follows NVIDIA/apex `csrc/megatron/fused_weight_gradient_dense.cpp` (the two bindings) and
`fused_weight_gradient_dense_cuda.cu` / `fused_weight_gradient_dense_16bit_prec_cuda.cu`: both
arguments are flattened to 2D over their leading dims ([tokens, in], [tokens, out]) and one cuBLAS
GEMM with alpha = beta = 1 and FP32 compute adds d_output^T @ input into d_weight [out, in] in
place, written once in d_weight's dtype. On the CPU the products of 16-bit inputs are exact in
FP32, so only the summation order differs from cuBLAS.
"""

from __future__ import annotations

import torch

_FP32_INPUTS = (torch.float32, torch.float16, torch.bfloat16)  # DISPATCH_FLOAT_HALF_AND_BFLOAT
_16BIT_INPUTS = (torch.float16, torch.bfloat16)  # DISPATCH_HALF_AND_BFLOAT


def _flatten(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 2 else tensor


def _accumulate(input: torch.Tensor, d_output: torch.Tensor, d_weight: torch.Tensor, name: str,
                inputs: tuple, weight_dtype) -> None:
    if input.dtype not in inputs:
        raise RuntimeError(f'"{name}" not implemented for \'{input.dtype}\'')
    if d_output.dtype != input.dtype or d_weight.dtype != weight_dtype(input.dtype):
        raise RuntimeError(f"{name}: expected input and d_output of one dtype and d_weight "
                           f"{weight_dtype(input.dtype)}, got {input.dtype}, {d_output.dtype}, "
                           f"{d_weight.dtype}")
    input_2d, d_output_2d = _flatten(input), _flatten(d_output)
    total = d_weight.float() + d_output_2d.float().t() @ input_2d.float()
    d_weight.copy_(total)


def wgrad_gemm_accum_fp32(input: torch.Tensor, d_output: torch.Tensor, d_weight: torch.Tensor) -> None:
    """d_weight (FP32, [out, in]) += d_output^T @ input; input and d_output FP32, FP16 or BF16."""
    _accumulate(input, d_output, d_weight, "wgrad_gemm_accum_fp32", _FP32_INPUTS,
                lambda _: torch.float32)


def wgrad_gemm_accum_fp16(input: torch.Tensor, d_output: torch.Tensor, d_weight: torch.Tensor) -> None:
    """d_weight (FP16 / BF16, the inputs' dtype) += d_output^T @ input, FP32 compute, one rounding."""
    _accumulate(input, d_output, d_weight, "wgrad_gemm_accum_fp16", _16BIT_INPUTS, lambda dtype: dtype)
