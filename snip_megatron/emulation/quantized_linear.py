"""One autograd function for a linear layer whose three GEMMs read quantized operands.

    fprop:  Y   = Q(X)   @ Q(W)^T
    dgrad:  G_X = Q(G_Y) @ Q(W)
    wgrad:  G_W = Q(G_Y)^T @ Q(X)

Each Q is the role quantizer of the layer's FormatSpec (formats.Role). Quantized operands are
dequantized to float32 and multiplied in float32 (the tensor cores accumulate in FP32); results come
back in the input's dtype (G_W in the weight's). Operands that a spec leaves unquantized (BF16) go
through the plain GEMM in their own dtype, as Megatron's local linear computes it.
Works on any device. Each operand is quantized once per GEMM role, and once for two roles whose
casts give the same values (`shares_quantization`): W's fprop and dgrad casts with one scale or
square tiles (blockwise FP8's 128x128, NVFP4's 16x16); X's and G_Y's under tensorwise FP8.
Backward keeps what its GEMMs read: X in high precision, re-quantized for wgrad along the token
dim (or, under tensorwise FP8, fprop's quantized X in its place), and fprop's quantized W where
dgrad shares its quantization. Quantized operands are kept in FP32, the form the emulated GEMM
reads: a kept quantized W costs 4 bytes per weight element from forward to backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from snip_megatron.formats import FormatSpec, Role, Rounding, quantize_for_role
from snip_megatron.formats.sr_noise import CounterNoise, draw_seed, shard_noise


@dataclass(frozen=True, kw_only=True)
class QuantRuntime:
    """What a quantized linear needs besides its formats: where operands are sharded and where
    random bits come from. The defaults describe a single, unsharded layer."""

    input_group: Any = None
    """Process group X is sharded over (its per-tensor amaxes are all-reduced there); None: whole."""
    weight_group: Any = None
    """Process group W is sharded over; None: whole."""
    grad_output_group: Any = None
    """Process group G_Y is sharded over; None: whole."""
    grad_output_shard: tuple[int, int, int] = (0, 1, 1)
    """(rank, world, partition stride) of G_Y's sharded last dim: stochastic-rounding noise is the
    whole G_Y's, at this shard's columns (formats/sr_noise.py shard_noise), so TP=N rounds exactly
    as TP=1."""
    generator: torch.Generator | None = None
    """Dedicated generator for stochastic rounding (never the global RNG); on G_Y's device."""
    accumulate_into_main_grad: bool = False
    """Megatron's gradient_accumulation_fusion: add G_W into weight.main_grad (FP32)."""


def quantized_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     spec: FormatSpec, runtime: QuantRuntime | None = None) -> torch.Tensor:
    """Y = Q(X) Q(W)^T (+ bias) with the backward GEMMs quantized by `spec`; input [..., k]."""
    return QuantizedLinear.apply(input, weight, bias, spec, runtime or QuantRuntime())


class QuantizedLinear(torch.autograd.Function):
    """See the module docstring; use `quantized_linear(...)`."""

    @staticmethod
    def forward(ctx, input, weight, bias, spec: FormatSpec, runtime: QuantRuntime):
        input_hp = input.reshape(-1, input.shape[-1])
        input_q = _q(input_hp, spec, Role.FPROP_INPUT, runtime.input_group)
        weight_q = _q(weight, spec, Role.FPROP_WEIGHT, runtime.weight_group)
        output = _gemm(input_q, weight_q.t())
        if bias is not None:
            output = output + bias  # in FP32 when quantized, as a GEMM epilogue
        # Save what the backward GEMMs read: fprop's quantized operand where the backward role
        # shares its quantization, else the high-precision one (re-quantized in backward).
        share_input = ctx.needs_input_grad[1] and shares_quantization(spec, Role.FPROP_INPUT, Role.WGRAD_INPUT)
        wgrad_input = input_q if share_input else input_hp
        dgrad_weight_q = (weight_q if ctx.needs_input_grad[0]
                          and shares_quantization(spec, Role.FPROP_WEIGHT, Role.DGRAD_WEIGHT) else None)
        ctx.save_for_backward(wgrad_input, weight, dgrad_weight_q)
        ctx.spec, ctx.runtime, ctx.has_bias = spec, runtime, bias is not None
        ctx.input_shape, ctx.input_dtype = input.shape, input.dtype
        ctx.wgrad_input_is_quantized = share_input
        return output.to(input.dtype).reshape(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        wgrad_input, weight, dgrad_weight_q = ctx.saved_tensors
        spec, runtime = ctx.spec, ctx.runtime
        grad_output_hp = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = grad_bias = grad_output_q = None

        if ctx.needs_input_grad[0]:
            grad_output_q = _q(grad_output_hp, spec, Role.DGRAD_GRAD_OUTPUT,
                               runtime.grad_output_group, runtime)
            if dgrad_weight_q is None:
                dgrad_weight_q = _q(weight, spec, Role.DGRAD_WEIGHT, runtime.weight_group)
            grad_input = _gemm(grad_output_q, dgrad_weight_q).to(ctx.input_dtype).reshape(ctx.input_shape)

        if ctx.needs_input_grad[1]:
            if grad_output_q is not None and shares_quantization(spec, Role.DGRAD_GRAD_OUTPUT,
                                                                 Role.WGRAD_GRAD_OUTPUT):
                grad_output_q_t = grad_output_q
            else:
                grad_output_q_t = _q(grad_output_hp, spec, Role.WGRAD_GRAD_OUTPUT,
                                     runtime.grad_output_group, runtime)
            input_q_t = (wgrad_input if ctx.wgrad_input_is_quantized
                         else _q(wgrad_input, spec, Role.WGRAD_INPUT, runtime.input_group))
            grad_weight = _gemm(grad_output_q_t.t(), input_q_t).to(weight.dtype)
            if runtime.accumulate_into_main_grad:
                grad_weight = _accumulate_main_grad(weight, grad_weight)

        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output_hp.sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None


def shares_quantization(spec: FormatSpec, a: Role, b: Role) -> bool:
    """Whether roles `a` and `b` of one operand quantize it to the same values: the same cast,
    deterministic (nearest rounding, no Hadamard transform), and blocks that do not depend on which
    dim is contracted (one scale for the tensor, or square tiles)."""
    cast = spec.cast(a)
    return (cast is not None and cast == spec.cast(b) and not cast.hadamard
            and cast.rounding is Rounding.NEAREST_EVEN
            and (cast.block is None or cast.block[0] == cast.block[1]))


def _q(tensor, spec, role, group, runtime: QuantRuntime | None = None):
    cast = spec.cast(role)
    if cast is None:
        return tensor
    noise = None
    if cast.rounding is Rounding.STOCHASTIC:
        noise = _shard_noise(tensor, runtime)
    return quantize_for_role(tensor, spec, role, out_dtype=torch.float32, noise=noise,
                             amax_group=group)


def _shard_noise(grad_output: torch.Tensor, runtime: QuantRuntime) -> "CounterNoise | torch.Tensor":
    """This shard's columns of the whole G_Y's counter-based noise, seeded by one draw from the
    layer's generator (the same draw on every TP rank)."""
    if runtime.generator is None:
        raise ValueError("this FormatSpec rounds gradients stochastically: QuantRuntime.generator "
                         "must be a torch.Generator")
    rank, world, stride = runtime.grad_output_shard
    return shard_noise(draw_seed(runtime.generator), grad_output.shape, rank=rank, world=world,
                       stride=stride, device=grad_output.device)


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.float32 or b.dtype == torch.float32:
        # Quantized operands: FP32 products and accumulation. TF32 (which Megatron may enable)
        # would round the dequantized values again, so run this GEMM at "highest" precision.
        previous = torch.get_float32_matmul_precision()
        if previous != "highest":
            torch.set_float32_matmul_precision("highest")
        try:
            return torch.matmul(a.float(), b.float())
        finally:
            if previous != "highest":
                torch.set_float32_matmul_precision(previous)
    return torch.matmul(a, b)  # both unquantized: the plain GEMM, as Megatron's layer


def _accumulate_main_grad(weight: torch.Tensor, grad_weight: torch.Tensor):
    # As Megatron's fused path: G_W goes into main_grad; autograd gets a placeholder (so DDP's
    # hooks still fire on the main thread) or None.
    weight.main_grad.add_(grad_weight.to(weight.main_grad.dtype))
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return make(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
    return None
