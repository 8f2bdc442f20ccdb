"""A Transformer Engine linear, unfused and unquantized, for the measurement's passes.

SNIP's statistics hooks read a planned linear's GEMM input X, its output Y and their gradients.
Megatron's TE spec fuses the norm into the column-parallel linears that follow a norm
(TELayerNormColumnParallelLinear, with `input_layernorm=IdentityOp`), so a hook on that module sees the residual stream, not
the normalised X the GEMM reads; and TE runs each linear in its planned FP8/FP4 recipe inside its
own autocast. For a measurement pass, `unfused(module)` therefore runs the module as Megatron's local
linear would, in the parameters' precision: the norm (TE's arithmetic: FP32, then the activation
dtype), then one plain GEMM in a `GemmView`, a small module the hooks attach to, with Megatron's own
tensor-parallel mappings around it (sequence-parallel gather or copy for a column-parallel linear;
reduce or reduce-scatter for a row-parallel one; none for a duplicated one, whose whole weight
works on this rank's tokens). The module's parameters are used as they are
(nothing is copied) and its own forward comes back when the context ends.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def is_fused_norm_linear(module) -> bool:
    """TE's LayerNormLinear (and Megatron's TELayerNormColumnParallelLinear on it)."""
    return hasattr(module, "layer_norm_weight") and hasattr(module, "normalization")


def te_norm(module, x: torch.Tensor) -> torch.Tensor:
    """The norm a TE LayerNormLinear applies before its GEMM, in TE's arithmetic."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    if module.normalization == "RMSNorm":
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + module.eps)
    elif module.normalization == "LayerNorm":
        y = F.layer_norm(x32, x.shape[-1:], eps=module.eps)
    else:
        raise ValueError(f"{type(module).__name__}: unknown normalization {module.normalization!r}")
    weight = module.layer_norm_weight.to(x32.dtype)
    y = y * (weight + 1.0 if getattr(module, "zero_centered_gamma", False) else weight)
    bias = getattr(module, "layer_norm_bias", None)
    if bias is not None:
        y = y + bias.to(x32.dtype)
    return y.to(x.dtype)


class GemmView(torch.nn.Module):
    """Y = X W^T of a TE linear with Megatron's TP mappings, unquantized; the measurement's hooks
    attach here. `weight` is the TE module's own Parameter (not registered a second time)."""

    def __init__(self, module, column: bool, duplicated: bool = False):
        super().__init__()
        self._module = [module]  # a list: not a submodule, so its parameters are not listed twice
        self.column, self.duplicated = column, duplicated
        self.sequence_parallel = bool(getattr(module, "sequence_parallel", False))

    @property
    def weight(self) -> torch.nn.Parameter:
        return self._module[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.duplicated:
            return F.linear(x, self.weight)
        if self.column:
            x = (mappings.gather_from_sequence_parallel_region(x) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(x))
            return F.linear(x, self.weight)
        y = F.linear(x, self.weight)
        return (mappings.reduce_scatter_to_sequence_parallel_region(y) if self.sequence_parallel
                else mappings.reduce_from_tensor_model_parallel_region(y))


@contextlib.contextmanager
def unfused(module, column: bool, duplicated: bool = False):
    """Run `module` (a Megatron TE linear) as norm + GemmView while the context lasts; yields the
    view. Output convention as Megatron's wrappers: (output, bias or None)."""
    if getattr(module, "return_layernorm_output", False):
        raise ValueError(f"{type(module).__name__} returns its norm output (return_layernorm_output); "
                         "SNIP's measurement cannot unfuse it")
    view = GemmView(module, column, duplicated)
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) and bias.numel() else None
    returns_bias = bool(getattr(module, "te_return_bias", False))

    def forward(x, *args, **kwargs):
        out = view(te_norm(module, x) if is_fused_norm_linear(module) else x)
        if bias is not None and not returns_bias:
            return out + bias, None
        return out, bias if returns_bias else None

    module.forward = forward
    try:
        yield view
    finally:
        del module.forward  # the class's forward (Megatron's wrapper) again
