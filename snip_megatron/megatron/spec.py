"""Layer specs: Megatron's GPT layer specs with SNIP's planned linears put in.

The four planned linears (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) go in
through the spec, as Megatron intends, rather than by patching modules after construction.
megatron-core 0.16 builds the MLP as ``ModuleSpec(MLP, submodules=MLPSubmodules)``; 0.17+ as
``functools.partial(MLP.as_mlp_submodule, submodules=...)``. `replace_planned_linears` handles both.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

BACKENDS = ("emulated", "local", "te")
"""Planned-linear backends: SNIP's emulated linears (any device, any plan), Megatron's plain local
linears (a BF16 reference), Transformer Engine's linears (planned through quant_recipe)."""


def _replace_mlp_linears(mlp_spec, column_cls, row_cls):
    if isinstance(mlp_spec, functools.partial):  # megatron-core >= 0.17
        submodules = mlp_spec.keywords["submodules"]
        new = dataclasses.replace(submodules, linear_fc1=column_cls, linear_fc2=row_cls)
        return functools.partial(mlp_spec.func, *mlp_spec.args,
                                 **{**mlp_spec.keywords, "submodules": new})
    mlp_spec.submodules.linear_fc1 = column_cls  # megatron-core 0.16: a ModuleSpec (deep-copied)
    mlp_spec.submodules.linear_fc2 = row_cls
    return mlp_spec


def replace_planned_linears(layer_spec, column_cls, row_cls):
    """A copy of a GPT layer spec whose qkv/fc1 use `column_cls` and proj/fc2 use `row_cls`."""
    spec = copy.deepcopy(layer_spec)
    attention = spec.submodules.self_attention.submodules
    attention.linear_qkv = column_cls
    attention.linear_proj = row_cls
    spec.submodules.mlp = _replace_mlp_linears(spec.submodules.mlp, column_cls, row_cls)
    return spec


def get_local_layer_spec(normalization: str = "RMSNorm"):
    """Megatron's own local (non-TE) GPT layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(normalization=normalization)


def get_snip_layer_spec(normalization: str = "RMSNorm"):
    """The local spec with SNIP's emulated quantized linears as the planned linears."""
    from snip_megatron.emulation.parallel_linear import (QuantColumnParallelLinear,
                                                         QuantRowParallelLinear)

    return replace_planned_linears(get_local_layer_spec(normalization),
                                   QuantColumnParallelLinear, QuantRowParallelLinear)


def get_te_layer_spec():
    """Megatron's Transformer Engine GPT layer spec (GPU; TE linears read quant_recipe themselves)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec()


def get_layer_spec(backend: str = "emulated", normalization: str = "RMSNorm"):
    """Spec by backend name: "emulated" (SNIP linears, any device), "local" (Megatron's plain
    linears, a reference), "te" (Transformer Engine, GPU only)."""
    if backend == "emulated":
        return get_snip_layer_spec(normalization)
    if backend == "local":
        return get_local_layer_spec(normalization)
    if backend == "te":
        if normalization != "RMSNorm":
            raise ValueError("the TE spec takes its normalization from TransformerConfig.normalization")
        return get_te_layer_spec()
    raise ValueError(f"unknown linear backend {backend!r}; valid: {', '.join(BACKENDS)}")
