"""A quantized te.Linear's three GEMMs, as TE 2.14's `_Linear` runs them, over the double's own
quantizers (`_quantize.py`; nothing here imports snip_megatron):

    fprop:  Y   = Q_row(X)  @ Q_row(W)^T     (linear.py:318-333, "y = x * w^T")
    dgrad:  G_X = Q_row(G_Y) @ Q_col(W)^T    (linear.py:687-725, "dx = dy * w": the weight's
                                              column-wise usage, :694-695)
    wgrad:  G_W = Q_col(G_Y) @ Q_col(X)^T    (linear.py:870-884, "dw = dy^T * x": both
                                              column-wise, where NVFP4's RHT applies)

Each GEMM multiplies the two operands' dequantized FP32 values at FP32 "highest" precision (no
TF32) and adds the bias in FP32 (cuBLAS's epilogue, linear.py:323-333). Outputs come back in the
input's dtype, G_W in the weight operand's (FP32 under fused wgrad accumulation, linear.py:849-853).
The grad output's two copies (linear.py:575-597) each get their own stochastic-rounding draws
(csrc/quantizer.cpp:2241-2262: separate RNG states), row-wise (dgrad) first; the double makes a
copy only when its GEMM runs (TE always makes the row-wise one, which only moves its RNG).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from transformer_engine.pytorch.module._quantize import TEQuantizer, quantize


@dataclass(frozen=True)
class LinearQuantizers:
    """The quantizers a te.Linear's GEMMs read under one recipe (TE's `RecipeState.make_quantizers`
    for the forward's input and weight and the backward's grad output); what `module.last_run.spec`
    reports."""

    recipe: str
    """The double's name for the recipe's numerics: "blockwise", "tensorwise", "mxfp8", "nvfp4"."""
    input: TEQuantizer
    weight: TEQuantizer
    grad_output: TEQuantizer

    def short_str(self) -> str:
        return (f"{self.recipe}: input=[{self.input.short_str()}] weight=[{self.weight.short_str()}] "
                f"grad_output=[{self.grad_output.short_str()}]")


def fp32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T in FP32 at "highest" precision (Megatron may enable TF32, which would round the
    dequantized values again)."""
    previous = torch.get_float32_matmul_precision()
    if previous != "highest":
        torch.set_float32_matmul_precision("highest")
    try:
        return torch.matmul(a, b.t())
    finally:
        if previous != "highest":
            torch.set_float32_matmul_precision(previous)


def quantized_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     quantizers: LinearQuantizers, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Y = X W^T (+ b) with TE's quantized GEMMs; `generator` feeds stochastic rounding."""
    return _QuantizedLinear.apply(inp, weight, bias, quantizers, generator)


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, quantizers: LinearQuantizers, generator):
        x = inp.reshape(-1, inp.shape[-1])
        x_row = quantize(x, quantizers.input, columnwise=False).values
        w_row = quantize(weight, quantizers.weight, columnwise=False).values
        out = fp32_mm(x_row, w_row)
        if bias is not None:
            out = out + bias.float()
        ctx.save_for_backward(x, weight)
        ctx.quantizers, ctx.generator = quantizers, generator
        ctx.input_shape, ctx.input_dtype, ctx.has_bias = inp.shape, inp.dtype, bias is not None
        return out.to(inp.dtype).reshape(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        q, generator = ctx.quantizers, ctx.generator
        g = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            g_row = quantize(g, q.grad_output, columnwise=False, generator=generator).values
            w_col = quantize(weight, q.weight, columnwise=True).values
            grad_input = fp32_mm(g_row, w_col).to(ctx.input_dtype).reshape(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            g_col = quantize(g, q.grad_output, columnwise=True, generator=generator).values
            x_col = quantize(x, q.input, columnwise=True).values
            grad_weight = fp32_mm(g_col, x_col).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g.sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None
