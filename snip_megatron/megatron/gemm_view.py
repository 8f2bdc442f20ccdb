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

A grouped expert linear (Megatron's TEGroupedLinear over TE's GroupedLinear, `--moe-grouped-gemm`)
becomes one GemmView per expert GEMM (`weight<i>`): the rows of its input are split by the
forward's `m_splits`, as TE splits them, so each expert's GEMM gets hooks of its own, exactly as a
SequentialMLP's local experts do. No TP mapping: TE's grouped GEMM communicates nothing (Megatron's
token dispatcher does). Under expert TP a gated fc1's shard on each rank is its [gate | up] rows, as
the MLP's fc1 with `stride=2` (transformer/mlp.py:206-216 @0.19.2), though Megatron marks TE's
grouped weights `partition_stride = 1` (extensions/transformer_engine.py:121-123): the views carry
the stride the rows really have (`GemmView.partition_stride`), which places the measurement's noise
and stochastic rounding at each row's feature of the whole GEMM.
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

    def __init__(self, module, column: bool, duplicated: bool = False, weight_name: str = "weight",
                 partition_stride: "int | None" = None):
        super().__init__()
        self._module = [module]  # a list: not a submodule, so its parameters are not listed twice
        self.column, self.duplicated = column, duplicated
        self.sequence_parallel = bool(getattr(module, "sequence_parallel", False))
        self.weight_name = weight_name  # a grouped linear's expert: "weight<i>"
        # how many interleaved parts each TP shard holds (Megatron's partition_stride)
        self.partition_stride = partition_stride or int(getattr(self.weight, "partition_stride", 1) or 1)

    @property
    def weight(self) -> torch.nn.Parameter:
        return getattr(self._module[0], self.weight_name)

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


def is_grouped_linear(module) -> bool:
    """TE's GroupedLinear (Megatron's TEGroupedLinear on it): one GEMM per expert, `weight<i>`."""
    return isinstance(getattr(module, "num_gemms", None), int) and hasattr(module, "weight0")


@contextlib.contextmanager
def unfused_grouped(module, column: bool = False):
    """Run a grouped expert linear as one plain GEMM per expert while the context lasts; yields the
    experts' views in expert order. Output convention as Megatron's TEGroupedLinear: (output, None),
    or (output, [bias<i>]) when it returns its biases. `column`: it is the column-parallel fc1 (of
    a gated MLP, its rows are [gate | up] on every expert-TP rank: stride 2)."""
    stride = 2 if column and getattr(module.config, "gated_linear_unit", False) else 1
    views = [GemmView(module, column=False, duplicated=True, weight_name=f"weight{i}", partition_stride=stride)
             for i in range(module.num_gemms)]
    biases = [getattr(module, f"bias{i}") for i in range(module.num_gemms)] if module.use_bias else None
    returns_bias = bool(getattr(module, "te_return_bias", False))

    def forward(x, m_splits, *args, **kwargs):
        parts = x.reshape(-1, x.shape[-1]).split([int(m) for m in m_splits])
        outs = [view(part) for view, part in zip(views, parts)]
        if biases is not None and not returns_bias:
            outs = [out + b for out, b in zip(outs, biases)]
        out = torch.cat(outs)
        return out, (biases if returns_bias else None)

    module.forward = forward
    try:
        yield views
    finally:
        del module.forward
