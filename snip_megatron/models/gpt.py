"""Dense GPTModel adapter: the four planned linears of each TransformerLayer.

The only place that names them. Keys are (global `TransformerLayer.layer_number`, linear name);
module paths inside a chunk use the layer index local to the pipeline stage / virtual chunk, so a
chunk's layer offset (Megatron's `get_transformer_layer_offset`) turns one into the other.
Megatron is never imported here (the layer-spec helpers and `discover` work on objects Megatron
built), so the pure parts of SNIP can use the rest.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from typing import NamedTuple

from snip_megatron.models.inventory import Inventory, InventoryEntry, ParallelKind, Unplanned
from snip_megatron.models.keys import LayerKey
from snip_megatron.shapes import ModelShape

FAMILY = "gpt"


class LinearSlot(NamedTuple):
    """Where a planned linear sits in a TransformerLayer and how TP shards it."""

    name: str
    suffix: str
    kind: ParallelKind


LINEARS = (
    LinearSlot("linear_qkv", "self_attention.linear_qkv", ParallelKind.COLUMN),
    LinearSlot("linear_proj", "self_attention.linear_proj", ParallelKind.ROW),
    LinearSlot("linear_fc1", "mlp.linear_fc1", ParallelKind.COLUMN),
    LinearSlot("linear_fc2", "mlp.linear_fc2", ParallelKind.ROW),
)
"""The planned linears of one layer, in forward order."""
LINEAR_NAMES = tuple(s.name for s in LINEARS)
SLOTS = {s.name: s for s in LINEARS}

UNPLANNED = (
    Unplanned("embedding", "embeddings stay in BF16"),
    Unplanned("decoder.layers.*.input_layernorm", "norms stay in BF16"),
    Unplanned("decoder.layers.*.pre_mlp_layernorm", "norms stay in BF16"),
    Unplanned("decoder.layers.*.self_attention.core_attention", "the attention core stays in BF16"),
    Unplanned("decoder.final_layernorm", "norms stay in BF16"),
    Unplanned("output_layer", "the output layer stays in BF16"),
)

# A planned linear inside a GPTModel chunk (optionally under DDP's `module.`). MTP layers
# (`mtp.layers...`) and MoE experts (`mlp.experts...`) do not match: not planned.
_PATH = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.(" + "|".join(re.escape(s.suffix) for s in LINEARS) + r")$")
_NAME_OF_SUFFIX = {s.suffix: s.name for s in LINEARS}


def parse_path(module_path: str) -> "tuple[int, str] | None":
    """(stage-local 0-based layer index, linear name) of a planned linear's module path, else None."""
    m = _PATH.search(module_path)
    return (int(m.group(1)), _NAME_OF_SUFFIX[m.group(2)]) if m else None


def layer_path(module_path: str) -> str:
    """The path of the TransformerLayer holding a planned linear ("...decoder.layers.<i>")."""
    m = _PATH.search(module_path)
    if m is None:
        raise ValueError(f"{module_path!r} is not a planned linear of a GPT layer")
    return module_path[: m.start(2) - 1]


def key_for_path(module_path: str, layer_offset: int = 0) -> "LayerKey | None":
    """The global key of a module path in a chunk whose first layer is `layer_offset` + 1."""
    parsed = parse_path(module_path)
    if parsed is None:
        return None
    local, name = parsed
    return LayerKey(layer_offset + local + 1, name)


def module_path(key: LayerKey, layer_offset: int = 0) -> str:
    """The path Megatron gives `key` inside the chunk whose first layer is `layer_offset` + 1."""
    local = key.layer - layer_offset - 1
    if local < 0 or key.name not in SLOTS:
        raise ValueError(f"{key} is not a planned linear of a GPT chunk starting after layer {layer_offset}")
    return f"decoder.layers.{local}.{SLOTS[key.name].suffix}"


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each planned linear of a layer, unsharded."""
    qkv_out = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.head_dim
    fc1_out = (2 if shape.gated_linear_unit else 1) * shape.ffn_hidden_size  # SwiGLU: gate and up
    return {
        "linear_qkv": (qkv_out, shape.hidden_size),
        "linear_proj": (shape.hidden_size, shape.num_attention_heads * shape.head_dim),
        "linear_fc1": (fc1_out, shape.hidden_size),
        "linear_fc2": (shape.hidden_size, shape.ffn_hidden_size),
    }


def keys(num_layers: int) -> list[LayerKey]:
    """Every key of a GPT with `num_layers` layers, in forward order (no shape needed)."""
    return [LayerKey(layer, s.name) for layer in range(1, num_layers + 1) for s in LINEARS]


def entry(layer: int, name: str, out_in: tuple[int, int], *, sequence_parallel: bool = False) -> InventoryEntry:
    slot = SLOTS[name]
    # Under SP a column-parallel linear gathers its token-sharded input itself; a row-parallel one
    # reads the TP-sharded hidden dim of whole sequences.
    return InventoryEntry(LayerKey(layer, name), slot.suffix, (int(out_in[0]), int(out_in[1])), slot.kind,
                          sequence_parallel and slot.kind is not ParallelKind.ROW)


def inventory(shape: ModelShape, *, sequence_parallel: bool = False) -> Inventory:
    """Every planned linear of a GPT of `shape`, without building it (the 70B layout in microseconds)."""
    shapes = linear_shapes(shape)
    return Inventory(FAMILY, (entry(layer, s.name, shapes[s.name], sequence_parallel=sequence_parallel)
                              for layer in range(1, shape.num_layers + 1) for s in LINEARS), UNPLANNED)


def _pattern(path: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


def planned_modules(chunk):
    """(module path, module, entry) of every planned linear of one built chunk, in registration
    order; `entry` is the linear's inventory entry, its layer number the enclosing layer's
    `layer_number`, its whole shape its weight's times TP along the sharded dim."""
    for path, module in chunk.named_modules():
        parsed = parse_path(path)
        if parsed is None:
            continue
        number = getattr(chunk.get_submodule(layer_path(path)), "layer_number", None)
        if not isinstance(number, int):
            raise ValueError(f"{layer_path(path)!r} has no integer layer_number; not a TransformerLayer?")
        config = getattr(module, "config", None)
        tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        out_f, in_f = (int(d) for d in module.weight.shape)
        kind = SLOTS[parsed[1]].kind
        whole = (out_f * tp, in_f) if kind is ParallelKind.COLUMN else (out_f, in_f * tp)
        yield path, module, entry(number, parsed[1], whole,
                                  sequence_parallel=bool(getattr(config, "sequence_parallel", False)))


def discover(model_chunks) -> Inventory:
    """This rank's part of the inventory, read from its built chunk(s) (one, or a list under VPP).

    A planned linear is a module under `decoder.layers.<i>` that takes a quant_recipe through
    Megatron's `finish_init` (TE linears and SNIP's emulated ones). Other modules that take one
    (MTP, experts) are listed as unplanned."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    found, unplanned = [], dict.fromkeys(UNPLANNED)
    for chunk in chunks:
        for path, module, e in planned_modules(chunk):
            if callable(getattr(module, "finish_init", None)):
                found.append(e)
        for path, module in chunk.named_modules():
            if callable(getattr(module, "finish_init", None)) and parse_path(path) is None:
                unplanned[Unplanned(_pattern(path), "takes a quant_recipe but the GPT adapter does not plan "
                                                    "it (not a decoder layer's attention or dense MLP linear)")] = None
    order = {name: i for i, name in enumerate(LINEAR_NAMES)}
    found.sort(key=lambda e: (e.layer, order[e.key.name]))  # modules register proj before qkv
    return Inventory(FAMILY, found, unplanned)


# -- layer specs: which spec fields hold the planned linears ---------------------------------------


def _spec_fields(column_cls, row_cls) -> dict[str, dict[str, object]]:
    """{layer submodule: {spec field: class}}, each planned linear's class by its parallel kind."""
    out: dict[str, dict[str, object]] = {}
    for s in LINEARS:
        parent, leaf = s.suffix.split(".")
        out.setdefault(parent, {})[leaf] = column_cls if s.kind is ParallelKind.COLUMN else row_cls
    return out


def _submodules(module_spec):
    if isinstance(module_spec, functools.partial):  # megatron-core >= 0.17 builds the MLP as a partial
        return module_spec.keywords.get("submodules")
    return getattr(module_spec, "submodules", None)


def spec_lacks(layer_spec) -> list[str]:
    """The planned linears (module suffixes) a GPT layer spec has no field for (a block spec,
    another attention): SNIP cannot plan such a spec."""
    lacking = []
    for parent, fields in _spec_fields(None, None).items():
        subs = _submodules(getattr(getattr(layer_spec, "submodules", None), parent, None))
        lacking += [f"{parent}.{leaf}" for leaf in fields if not hasattr(subs, leaf)]
    return lacking


def spec_linear_class(layer_spec, suffix: str):
    """The class a GPT layer spec builds for the planned linear at `suffix` (None if it has none)."""
    parent, leaf = suffix.split(".")
    return getattr(_submodules(getattr(layer_spec.submodules, parent, None)), leaf, None)


def first_linear_suffix() -> str:
    """The suffix of a layer's first planned linear (the one a TE spec fuses the input norm into)."""
    return LINEARS[0].suffix


def replace_planned_linears(layer_spec, column_cls, row_cls):
    """A copy of a GPT layer spec whose column-parallel planned linears are `column_cls` and
    row-parallel ones `row_cls`. megatron-core 0.16 builds the MLP as `ModuleSpec(MLP,
    submodules=MLPSubmodules)`, 0.17+ as `functools.partial(MLP.as_mlp_submodule, submodules=...)`."""
    spec = copy.deepcopy(layer_spec)
    for parent, fields in _spec_fields(column_cls, row_cls).items():
        module_spec = getattr(spec.submodules, parent)
        if isinstance(module_spec, functools.partial):
            new = dataclasses.replace(module_spec.keywords["submodules"], **fields)
            module_spec = functools.partial(module_spec.func, *module_spec.args,
                                            **{**module_spec.keywords, "submodules": new})
        else:  # a ModuleSpec (deep-copied above)
            for leaf, cls in fields.items():
                setattr(module_spec.submodules, leaf, cls)
        setattr(spec.submodules, parent, module_spec)
    return spec
