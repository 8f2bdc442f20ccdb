"""A GPT layer spec's planned linears: which fields of Megatron's ModuleSpecs (and the partials
megatron-core >= 0.17 builds) hold them, and copies of a spec with SNIP's linear classes in those
fields (the GPTModel adapter `models.gpt` names the linears; Megatron is never imported here)."""

from __future__ import annotations

import copy
import dataclasses
import functools

from snip_megatron.models import gpt
from snip_megatron.models.inventory import ParallelKind


def is_mla_spec(layer_spec) -> bool:
    """Whether a GPT layer spec builds multi-latent attention (its attention has MLA's fields)."""
    attention = _submodules(getattr(getattr(layer_spec, "submodules", None), "self_attention", None))
    return hasattr(attention, "linear_kv_down_proj")


def is_moe_spec(layer_spec) -> bool:
    """Whether a GPT layer spec builds an MoE layer (its MLP has experts)."""
    return hasattr(_submodules(getattr(getattr(layer_spec, "submodules", None), "mlp", None)), "experts")


def _spec_fields(column_cls, row_cls, duplicated_cls=None, mla: bool = False,
                 moe: bool = False) -> dict[str, dict[str, object]]:
    """{submodule path below the layer: {spec field: class}}, each planned linear's class by its
    parallel kind (an MoE layer's: its experts' and shared experts' MLP fields; its latent
    projections are TE linears MoELayer builds itself, no spec field)."""
    by_kind = {ParallelKind.COLUMN: column_cls, ParallelKind.ROW: row_cls,
               ParallelKind.DUPLICATED: column_cls if duplicated_cls is None else duplicated_cls}
    out: dict[str, dict[str, object]] = {}
    attention = (gpt.MLA_LINEARS + gpt.LINEARS[1:2]) if mla else gpt.LINEARS[:2]
    for s in attention + (gpt.EXPERT_LINEARS + gpt.SHARED_EXPERT_LINEARS if moe else gpt.LINEARS[2:]):
        parent, leaf = s.suffix.rsplit(".", 1)
        out.setdefault(parent, {})[leaf] = by_kind[s.kind]
    return out


def _submodules(module_spec):
    if isinstance(module_spec, functools.partial):  # megatron-core >= 0.17 builds the MLP as a partial
        return module_spec.keywords.get("submodules")
    return getattr(module_spec, "submodules", None)


def _spec_at(layer_spec, parent: str):
    """The submodules of the spec at `parent` ("mlp", "mlp.experts") below a layer spec (None if none)."""
    subs = getattr(layer_spec, "submodules", None)
    for part in parent.split("."):
        subs = _submodules(getattr(subs, part, None))
    return subs


def _with_fields(module_spec, fields: dict):
    """A copy of a ModuleSpec, or a functools.partial taking `submodules=` (megatron-core >= 0.17
    builds MLPs, MoE layers and experts so), whose submodules have `fields` set."""
    subs = _submodules(module_spec)
    if dataclasses.is_dataclass(subs):
        new = dataclasses.replace(subs, **fields)
    else:
        new = copy.copy(subs)
        for name, value in fields.items():
            setattr(new, name, value)
    if isinstance(module_spec, functools.partial):
        return functools.partial(module_spec.func, *module_spec.args, **{**module_spec.keywords, "submodules": new})
    module_spec = copy.copy(module_spec)
    module_spec.submodules = new
    return module_spec


def _replaced_at(module_spec, parts: list, fields: dict):
    if not parts:
        return _with_fields(module_spec, fields)
    child = getattr(_submodules(module_spec), parts[0])
    return _with_fields(module_spec, {parts[0]: _replaced_at(child, parts[1:], fields)})


def layer_specs(spec) -> "list | None":
    """The per-layer specs of a decoder block spec (TransformerBlockSubmodules, or a ModuleSpec
    holding them: Megatron-LM's spec with --num-experts), else None (one layer spec for every layer)."""
    specs = getattr(spec, "layer_specs", None)
    if specs is None:
        specs = getattr(getattr(spec, "submodules", None), "layer_specs", None)
    return None if specs is None else list(specs)


def map_layer_specs(spec, fn):
    """`fn(layer spec)` of a layer spec, or a copy of a block spec with `fn` of each of its layers."""
    specs = layer_specs(spec)
    if specs is None:
        return fn(spec)
    new = [fn(s) for s in specs]
    holder = spec if hasattr(spec, "layer_specs") else spec.submodules
    holder = dataclasses.replace(holder, layer_specs=new) if dataclasses.is_dataclass(holder) else holder
    if hasattr(spec, "layer_specs"):
        return holder
    spec = copy.copy(spec)
    spec.submodules = holder
    return spec


def spec_lacks(layer_spec) -> list[str]:
    """The planned linears (module suffixes) a GPT layer spec (or each layer of a block spec) has no
    field for (another attention, another MLP): SNIP cannot plan such a spec."""
    specs = layer_specs(layer_spec)
    if specs is not None:
        return list(dict.fromkeys(x for s in specs for x in spec_lacks(s)))
    lacking = []
    for parent, fields in _spec_fields(None, None, mla=is_mla_spec(layer_spec), moe=is_moe_spec(layer_spec)).items():
        subs = _spec_at(layer_spec, parent)
        lacking += [f"{parent}.{leaf}" for leaf in fields if not hasattr(subs, leaf)]
    return lacking


def spec_linear_class(layer_spec, suffix: str):
    """The class a GPT layer spec builds for the planned linear at `suffix` (None if it has none)."""
    parent, leaf = suffix.rsplit(".", 1)
    return getattr(_spec_at(layer_spec, parent), leaf, None)


def first_linear_suffix() -> str:
    """The suffix of a layer's first planned linear (the one a TE spec fuses the input norm into)."""
    return gpt.LINEARS[0].suffix


def replace_duplicated_linears(layer_spec, cls):
    """A copy of an MLA layer spec whose down-projections (duplicated over TP in the TE spec) are
    `cls`; the other linears stay as they are."""
    spec = copy.deepcopy(layer_spec)
    attention = _submodules(spec.submodules.self_attention)
    for s in gpt.MLA_LINEARS:
        if s.kind is ParallelKind.DUPLICATED:
            setattr(attention, s.suffix.split(".")[1], cls)
    return spec


def replace_mtp_planned_linears(block_spec, eh_proj_cls, layer_spec_fn):
    """A copy of a multi-token-prediction block spec (MultiTokenPredictionBlockSubmodules, or a
    ModuleSpec holding them) whose layers' eh_proj is `eh_proj_cls` (None keeps it) and inner layer
    spec `layer_spec_fn(spec)`."""
    spec = copy.deepcopy(block_spec)
    for layer in getattr(spec, "submodules", spec).layer_specs:
        if eh_proj_cls is not None:
            layer.submodules.eh_proj = eh_proj_cls
        inner = next(name for name in gpt.MTP_INNER if hasattr(layer.submodules, name))  # by release
        setattr(layer.submodules, inner, layer_spec_fn(getattr(layer.submodules, inner)))
    return spec


def replace_planned_linears(layer_spec, column_cls, row_cls, duplicated_cls=None):
    """A copy of a GPT layer spec (or of each layer of a block spec) whose column-parallel planned
    linears are `column_cls`, row-parallel ones `row_cls` and MLA's down-projections
    `duplicated_cls` (default `column_cls`, as Megatron's local spec has them); an MoE layer's
    experts' and shared experts' linears alike. megatron-core 0.16 builds the MLP as `ModuleSpec(MLP,
    submodules=MLPSubmodules)`, 0.17+ as `functools.partial(MLP.as_mlp_submodule, submodules=...)`."""
    if layer_specs(layer_spec) is not None:
        return map_layer_specs(layer_spec, lambda s: replace_planned_linears(s, column_cls, row_cls, duplicated_cls))
    spec = copy.deepcopy(layer_spec)
    fields = _spec_fields(column_cls, row_cls, duplicated_cls, mla=is_mla_spec(layer_spec), moe=is_moe_spec(layer_spec))
    for parent, leaves in fields.items():
        spec = _replaced_at(spec, parent.split("."), leaves)
    return spec
