"""One autograd function for a linear layer whose three GEMMs read quantized operands.

    fprop:  Y   = Q(X)   @ Q(W)^T
    dgrad:  G_X = Q(G_Y) @ Q(W)
    wgrad:  G_W = Q(G_Y)^T @ Q(X)

Each Q is the role quantizer of the layer's FormatSpec (formats.Role). Each GEMM is written as
A @ B^T with both operands in the GEMM layout (rows x K, the contracted dim last) and runs on
`emulation/gemm.py`'s path for the device: on CUDA the tensor cores (BF16 operands that hold every
quantized value exactly, FP32 accumulation, the FP32 scales applied to the FP32 result); on CPU the
dequantized operands in FP32. Results come back in the input's dtype (G_W in the weight's).
Operands that a spec leaves unquantized (BF16) go through the plain GEMM in their own dtype, as
Megatron's local linear computes it. Works on any device, with no host sync.
Each operand is quantized once per GEMM role, and once for two roles whose casts give the same
values (`shares_quantization`): W's fprop and dgrad casts with one scale or square tiles (blockwise
FP8's 128x128, NVFP4's 16x16); X's and G_Y's under tensorwise FP8. Backward keeps what its GEMMs
read: X in high precision, re-quantized for wgrad along the token dim (or, under tensorwise FP8,
fprop's quantized X in its place), and fprop's quantized W where dgrad shares its quantization, in
the GEMM's dtype (2 bytes per element on the tensor-core path, 4 on the FP32 one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from snip_megatron.emulation.gemm import fp32_mm, gemm_path, tensor_core_mm
from snip_megatron.formats import FormatSpec, Role, Rounding, ScaleFormat, quantize_for_role
from snip_megatron.formats.operand import GemmOperand, quantize_operand
from snip_megatron.formats.sr_noise import CounterNoise, draw_seed, shard_noise


@dataclass(frozen=True, kw_only=True)
class QuantRuntime:
    """What a quantized linear needs besides its formats: where operands are sharded, where
    random bits come from and which GEMM path runs. The defaults describe a single, unsharded
    layer on its device's default path."""

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
    generator: Any = None
    """Where stochastic-rounding seeds come from (never the global RNG): a host `SeedStream`
    (formats/sr_noise.py; no device sync) or a torch.Generator (`draw_seed`)."""
    accumulate_into_main_grad: bool = False
    """Megatron's gradient_accumulation_fusion: add G_W into weight.main_grad (FP32)."""
    gemm: str | None = None
    """"tensor_core" or "fp32" (emulation/gemm.py); None: SNIP_EMULATED_GEMM or the device's default."""


def quantized_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     spec: FormatSpec, runtime: QuantRuntime | None = None) -> torch.Tensor:
    """Y = Q(X) Q(W)^T (+ bias) with the backward GEMMs quantized by `spec`; input [..., k]."""
    return QuantizedLinear.apply(input, weight, bias, spec, runtime or QuantRuntime())


class QuantizedLinear(torch.autograd.Function):
    """See the module docstring; use `quantized_linear(...)`."""

    @staticmethod
    def forward(ctx, input, weight, bias, spec: FormatSpec, runtime: QuantRuntime):
        path = gemm_path(input.device, runtime.gemm, kblock=_has_block_scales(spec))
        input_hp = input.reshape(-1, input.shape[-1])
        input_q = _q(input_hp, spec, Role.FPROP_INPUT, runtime.input_group, path)
        weight_q = _q(weight, spec, Role.FPROP_WEIGHT, runtime.weight_group, path)
        output = _gemm(input_q, weight_q, spec.cast(Role.FPROP_INPUT) is not None)
        if bias is not None:
            output = output + bias  # in FP32 when quantized, as a GEMM epilogue
        # Save what the backward GEMMs read: fprop's quantized operand where the backward role
        # shares its quantization, else the high-precision one (re-quantized in backward).
        share_input = ctx.needs_input_grad[1] and shares_quantization(spec, Role.FPROP_INPUT, Role.WGRAD_INPUT)
        wgrad_input = input_q.t() if share_input else input_hp
        dgrad_weight_q = (weight_q.t() if ctx.needs_input_grad[0]
                          and shares_quantization(spec, Role.FPROP_WEIGHT, Role.DGRAD_WEIGHT) else None)
        (input_kept, ctx.input_meta), (weight_kept, ctx.weight_meta) = _pack(wgrad_input), _pack(dgrad_weight_q)
        ctx.save_for_backward(input_kept, weight, weight_kept)
        ctx.spec, ctx.runtime, ctx.path, ctx.has_bias = spec, runtime, path, bias is not None
        ctx.input_shape, ctx.input_dtype = input.shape, input.dtype
        ctx.wgrad_input_is_quantized = share_input
        return output.to(input.dtype).reshape(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        input_kept, weight, weight_kept = ctx.saved_tensors
        wgrad_input, dgrad_weight_q = _unpack(input_kept, ctx.input_meta), _unpack(weight_kept, ctx.weight_meta)
        spec, runtime, path = ctx.spec, ctx.runtime, ctx.path
        quantized = spec.cast(Role.DGRAD_GRAD_OUTPUT) is not None
        grad_output_hp = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = grad_bias = grad_output_q = None

        if ctx.needs_input_grad[0]:
            grad_output_q = _q(grad_output_hp, spec, Role.DGRAD_GRAD_OUTPUT,
                               runtime.grad_output_group, path, runtime)
            if dgrad_weight_q is None:
                dgrad_weight_q = _q(weight, spec, Role.DGRAD_WEIGHT, runtime.weight_group, path)
            grad_input = _gemm(grad_output_q, dgrad_weight_q, quantized)
            grad_input = grad_input.to(ctx.input_dtype).reshape(ctx.input_shape)

        if ctx.needs_input_grad[1]:
            if grad_output_q is not None and shares_quantization(spec, Role.DGRAD_GRAD_OUTPUT,
                                                                 Role.WGRAD_GRAD_OUTPUT):
                grad_output_q_t = grad_output_q.t()
            else:
                grad_output_q_t = _q(grad_output_hp, spec, Role.WGRAD_GRAD_OUTPUT,
                                     runtime.grad_output_group, path, runtime)
            input_q_t = (wgrad_input if ctx.wgrad_input_is_quantized
                         else _q(wgrad_input, spec, Role.WGRAD_INPUT, runtime.input_group, path))
            grad_weight = _gemm(grad_output_q_t, input_q_t, quantized).to(weight.dtype)
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


def _q(tensor, spec, role, group, path: str, runtime: QuantRuntime | None = None):
    """`tensor` (the role's operand in its natural layout) as the role's GEMM reads it, in the
    GEMM layout (rows x K): itself where the role is not quantized, else a GemmOperand (tensor-core
    path) or the dequantized FP32 tensor (FP32 path)."""
    cast = spec.cast(role)
    if cast is None:
        return tensor if role.contraction_dim == -1 else tensor.t()
    noise = None
    if cast.rounding is Rounding.STOCHASTIC:
        noise = _shard_noise(tensor, runtime)
    if path == "tensor_core":
        return quantize_operand(tensor, cast, dim=role.contraction_dim, noise=noise, amax_group=group)
    deq = quantize_for_role(tensor, spec, role, out_dtype=torch.float32, noise=noise, amax_group=group)
    return deq if role.contraction_dim == -1 else deq.t()


def _has_block_scales(spec: FormatSpec) -> bool:
    """Whether the spec's casts have FP32 block scales (the tensor-core path runs per K block)."""
    cast = spec.cast(Role.FPROP_INPUT)
    return cast is not None and cast.block is not None and cast.scale is ScaleFormat.FP32


def _gemm(a, b, quantized: bool) -> torch.Tensor:
    """a @ b^T of two operands in the GEMM layout."""
    if isinstance(a, GemmOperand):
        return tensor_core_mm(a, b)
    if quantized:
        return fp32_mm(a, b.t())
    return torch.matmul(a, b.t())  # both unquantized: the plain GEMM, as Megatron's layer


def _pack(operand):
    """(the tensor autograd saves, the rest): a GemmOperand's values go through save_for_backward."""
    if isinstance(operand, GemmOperand):
        return operand.values, operand._replace(values=None)
    return operand, None


def _unpack(tensor, rest):
    return tensor if rest is None else rest._replace(values=tensor)


def _shard_noise(grad_output: torch.Tensor, runtime: QuantRuntime) -> "CounterNoise | torch.Tensor":
    """This shard's columns of the whole G_Y's counter-based noise, seeded by one draw from the
    layer's seed stream (the same draw on every TP rank; on the host: no device sync)."""
    if runtime.generator is None:
        raise ValueError("this FormatSpec rounds gradients stochastically: QuantRuntime.generator "
                         "must be a SeedStream or a torch.Generator")
    rank, world, stride = runtime.grad_output_shard
    return shard_noise(draw_seed(runtime.generator), grad_output.shape, rank=rank, world=world,
                       stride=stride, device=grad_output.device)


def _accumulate_main_grad(weight: torch.Tensor, grad_weight: torch.Tensor):
    # As Megatron's fused path: G_W goes into main_grad; autograd gets a placeholder (so DDP's
    # hooks still fire on the main thread) or None.
    weight.main_grad.add_(grad_weight.to(weight.main_grad.dtype))
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return make(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
    return None
