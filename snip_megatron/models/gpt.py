"""GPTModel adapter: the planned linears of each TransformerLayer (dense attention, or
multi-latent attention with `--multi-latent-attention`) and its dense MLP.

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
from dataclasses import dataclass
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

MLA_LINEARS = (
    LinearSlot("linear_q_proj", "self_attention.linear_q_proj", ParallelKind.COLUMN),
    LinearSlot("linear_q_down_proj", "self_attention.linear_q_down_proj", ParallelKind.DUPLICATED),
    LinearSlot("linear_kv_down_proj", "self_attention.linear_kv_down_proj", ParallelKind.DUPLICATED),
    LinearSlot("linear_q_up_proj", "self_attention.linear_q_up_proj", ParallelKind.COLUMN),
    LinearSlot("linear_kv_up_proj", "self_attention.linear_kv_up_proj", ParallelKind.COLUMN),
)
"""Multi-latent attention's projections before its core (MLASelfAttention, in forward order: the
down-projections, then the up-projections; linear_q_proj without q_lora_rank). The TE spec builds
the down-projections as TELinear(parallel_mode="duplicated"): weights replicated over TP, input
token-sharded under SP. Megatron's local spec builds them as ColumnParallelLinear (gather_output
False, the output gathered by MLA; SNIP's local and emulated specs duplicate them as TE does), so a
built model's kind comes from its module (`module_kind`)."""
MLA_DOWN = tuple(s.name for s in MLA_LINEARS if s.kind is ParallelKind.DUPLICATED)
NAMES = ("linear_qkv",) + tuple(s.name for s in MLA_LINEARS) + LINEAR_NAMES[1:]
"""Every linear name a GPT layer can have, in forward order."""
MTP = "mtp."
"""Multi-token prediction: the prefix of its linears' names. Its layers are numbered 1..D again
(Megatron's MTP layer_number), so a key (depth k, "mtp.<name>") names linear <name> of MTP layer k:
no decoder layer's name starts with it, and MTP keys sort after every decoder key (models.order)."""
MTP_EH_PROJ = LinearSlot(MTP + "eh_proj", "eh_proj", ParallelKind.COLUMN)
"""An MTP layer's projection of [embedding; hidden] (2h -> h) before its inner layer."""
MTP_INNER = ("mtp_model_layer", "transformer_layer")
"""The inner transformer layer's module name: mtp_model_layer in megatron-core >= 0.17,
transformer_layer in 0.16."""


def mtp_slots(mla: "MLADims | None" = None) -> tuple[LinearSlot, ...]:
    """The planned linears of one MTP layer, in forward order: eh_proj, then its inner layer's."""
    return (MTP_EH_PROJ,) + tuple(LinearSlot(MTP + s.name, s.suffix, s.kind) for s in layer_slots(mla))


def is_mtp(key: LayerKey) -> bool:
    """Whether `key` names a linear of a multi-token-prediction layer."""
    return key.name.startswith(MTP)


SLOTS = {s.name: s for s in LINEARS + MLA_LINEARS}
SLOTS.update({MTP + s.name: LinearSlot(MTP + s.name, s.suffix, s.kind) for s in LINEARS + MLA_LINEARS})
SLOTS[MTP_EH_PROJ.name] = MTP_EH_PROJ

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
_PATH = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.(" + "|".join(re.escape(s.suffix) for s in SLOTS.values())
                   + r")$")
_NAME_OF_SUFFIX = {s.suffix: s.name for s in LINEARS + MLA_LINEARS}
_MTP_PATH = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.(?:(?:" + "|".join(MTP_INNER) + r")\.("
                       + "|".join(re.escape(s) for s in _NAME_OF_SUFFIX) + r")|(eh_proj))$")


@dataclass(frozen=True, kw_only=True)
class MLADims:
    """Multi-latent attention's widths (Megatron's MLATransformerConfig fields)."""

    q_lora_rank: "int | None" = None
    """None: queries come from one linear_q_proj; else linear_q_down_proj + linear_q_up_proj."""
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128

    @classmethod
    def of(cls, config) -> "MLADims | None":
        """The dims of a TransformerConfig with multi_latent_attention (None without it)."""
        if not getattr(config, "multi_latent_attention", False):
            return None
        return cls(**{f: getattr(config, f) for f in cls.__dataclass_fields__ if hasattr(config, f)})

    def attention_slots(self) -> tuple[LinearSlot, ...]:
        """The layer's attention linears before its core, in forward order."""
        skip = {"linear_q_proj"} if self.q_lora_rank is not None else {"linear_q_down_proj", "linear_q_up_proj"}
        return tuple(s for s in MLA_LINEARS if s.name not in skip)


def layer_slots(mla: "MLADims | None" = None) -> tuple[LinearSlot, ...]:
    """The planned linears of one layer, in forward order (dense attention without `mla`)."""
    if mla is None:
        return LINEARS
    return mla.attention_slots() + LINEARS[1:]


def parse_path(module_path: str) -> "tuple[int, str] | None":
    """(stage-local 0-based layer index, linear name) of a decoder layer's planned linear's module
    path, else None (MTP linears: `parse_mtp_path`)."""
    m = _PATH.search(module_path)
    return (int(m.group(1)), _NAME_OF_SUFFIX[m.group(2)]) if m else None


def parse_mtp_path(module_path: str) -> "LayerKey | None":
    """The key of an MTP layer's planned linear ("mtp.layers.<k-1>....": depth k), else None."""
    m = _MTP_PATH.search(module_path)
    if m is None:
        return None
    name = MTP_EH_PROJ.name if m.group(3) else MTP + _NAME_OF_SUFFIX[m.group(2)]
    return LayerKey(int(m.group(1)) + 1, name)


def layer_path(module_path: str) -> str:
    """The path of the TransformerLayer holding a planned linear ("...decoder.layers.<i>")."""
    m = _PATH.search(module_path)
    if m is None:
        raise ValueError(f"{module_path!r} is not a planned linear of a GPT layer")
    return module_path[: m.start(2) - 1]


def key_for_path(module_path: str, layer_offset: int = 0) -> "LayerKey | None":
    """The global key of a module path in a chunk whose first layer is `layer_offset` + 1 (an MTP
    linear's key does not depend on the offset)."""
    parsed = parse_path(module_path)
    if parsed is None:
        return parse_mtp_path(module_path)
    local, name = parsed
    return LayerKey(layer_offset + local + 1, name)


def module_kind(module) -> ParallelKind:
    """How TP shards a built planned linear: a TE linear says it (parallel_mode "column", "row", or
    None for "duplicated"); Megatron's local linears by their class (RowParallelLinear has
    input_is_parallel)."""
    if hasattr(module, "parallel_mode"):
        mode = module.parallel_mode
        return {"column": ParallelKind.COLUMN, "row": ParallelKind.ROW, None: ParallelKind.DUPLICATED}[mode]
    return ParallelKind.ROW if hasattr(module, "input_is_parallel") else ParallelKind.COLUMN


def module_path(key: LayerKey, layer_offset: int = 0) -> str:
    """The path Megatron gives `key` inside the chunk whose first layer is `layer_offset` + 1."""
    if is_mtp(key) and key.name in SLOTS:
        slot = SLOTS[key.name]
        inner = "" if slot is MTP_EH_PROJ else MTP_INNER[0] + "."
        return f"mtp.layers.{key.layer - 1}.{inner}{slot.suffix}"
    local = key.layer - layer_offset - 1
    if local < 0 or key.name not in SLOTS:
        raise ValueError(f"{key} is not a planned linear of a GPT chunk starting after layer {layer_offset}")
    return f"decoder.layers.{local}.{SLOTS[key.name].suffix}"


def linear_shapes(shape: ModelShape, mla: "MLADims | None" = None) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each planned linear of a layer, unsharded."""
    h, n = shape.hidden_size, shape.num_attention_heads
    qkv_out = (n + 2 * shape.num_query_groups) * shape.head_dim
    fc1_out = (2 if shape.gated_linear_unit else 1) * shape.ffn_hidden_size  # SwiGLU: gate and up
    out = {
        "linear_qkv": (qkv_out, h),
        "linear_proj": (h, n * shape.head_dim),
        "linear_fc1": (fc1_out, h),
        "linear_fc2": (h, shape.ffn_hidden_size),
    }
    if mla is None:
        return out
    q_head = mla.qk_head_dim + mla.qk_pos_emb_head_dim  # multi_latent_attention.py: q_head_dim
    mla_shapes = {
        "linear_q_proj": (n * q_head, h),
        "linear_q_down_proj": (mla.q_lora_rank or 0, h),
        "linear_q_up_proj": (n * q_head, mla.q_lora_rank or 0),
        "linear_kv_down_proj": (mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h),
        "linear_kv_up_proj": (n * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        "linear_proj": (h, n * mla.v_head_dim),
    }
    return {s.name: {**out, **mla_shapes}[s.name] for s in layer_slots(mla)}


def keys(num_layers: int, mla: "MLADims | None" = None) -> list[LayerKey]:
    """Every key of a GPT with `num_layers` layers, in forward order (no shape needed)."""
    return [LayerKey(layer, s.name) for layer in range(1, num_layers + 1) for s in layer_slots(mla)]


def entry(layer: int, name: str, out_in: tuple[int, int], *, sequence_parallel: bool = False,
          kind: "ParallelKind | None" = None) -> InventoryEntry:
    slot = SLOTS[name]
    kind = slot.kind if kind is None else ParallelKind(kind)
    # Under SP a column-parallel linear gathers its token-sharded input itself, and a duplicated one
    # works on this rank's tokens; a row-parallel one reads the TP-sharded hidden dim of whole sequences.
    return InventoryEntry(LayerKey(layer, name), slot.suffix, (int(out_in[0]), int(out_in[1])), kind,
                          sequence_parallel and kind is not ParallelKind.ROW)


def inventory(shape: ModelShape, *, sequence_parallel: bool = False, mla: "MLADims | None" = None,
              mtp_num_layers: int = 0) -> Inventory:
    """Every planned linear of a GPT of `shape` (with multi-latent attention of `mla`, and
    `mtp_num_layers` multi-token-prediction layers after the decoder), without building it (the
    70B layout in microseconds)."""
    shapes = linear_shapes(shape, mla)
    shapes.update({MTP + name: out_in for name, out_in in shapes.items()})
    shapes[MTP_EH_PROJ.name] = (shape.hidden_size, 2 * shape.hidden_size)
    decoder = ((layer, s) for layer in range(1, shape.num_layers + 1) for s in layer_slots(mla))
    mtp = ((depth, s) for depth in range(1, mtp_num_layers + 1) for s in mtp_slots(mla))
    return Inventory(FAMILY, [entry(layer, s.name, shapes[s.name], sequence_parallel=sequence_parallel)
                              for layer, s in (*decoder, *mtp)], UNPLANNED)


def of_config(config) -> Inventory:
    """Every planned linear of the GPT a TransformerConfig describes (or anything with its field
    names): its layers, widths and attention (multi-latent with `multi_latent_attention`)."""
    heads = config.num_attention_heads
    shape = ModelShape(name="config", num_layers=config.num_layers, hidden_size=config.hidden_size,
                       ffn_hidden_size=config.ffn_hidden_size, num_attention_heads=heads,
                       num_query_groups=getattr(config, "num_query_groups", None) or heads,
                       kv_channels=getattr(config, "kv_channels", None),
                       gated_linear_unit=bool(getattr(config, "gated_linear_unit", True)))
    return inventory(shape, mla=MLADims.of(config), mtp_num_layers=int(getattr(config, "mtp_num_layers", None) or 0),
                     sequence_parallel=bool(getattr(config, "sequence_parallel", False))
                     and int(getattr(config, "tensor_model_parallel_size", 1) or 1) > 1)


def _pattern(path: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


def planned_modules(chunk):
    """(module path, module, entry) of every planned linear of one built chunk, in registration
    order; `entry` is the linear's inventory entry, its layer number the enclosing layer's
    `layer_number`, its whole shape its weight's times TP along the sharded dim."""
    for path, module in chunk.named_modules():
        parsed = parse_path(path)
        mtp_key = parse_mtp_path(path) if parsed is None else None
        if parsed is None and mtp_key is None:
            continue
        if mtp_key is not None:  # MTP layers are numbered by their depth (the path's index + 1)
            number, parsed = mtp_key.layer, (None, mtp_key.name)
        else:
            number = getattr(chunk.get_submodule(layer_path(path)), "layer_number", None)
        if not isinstance(number, int):
            raise ValueError(f"{layer_path(path)!r} has no integer layer_number; not a TransformerLayer?")
        config = getattr(module, "config", None)
        tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        out_f, in_f = (int(d) for d in module.weight.shape)
        slot = SLOTS[parsed[1]]
        kind = module_kind(module) if slot.kind is ParallelKind.DUPLICATED else slot.kind
        whole = {ParallelKind.COLUMN: (out_f * tp, in_f), ParallelKind.ROW: (out_f, in_f * tp),
                 ParallelKind.DUPLICATED: (out_f, in_f)}[kind]
        yield path, module, entry(number, parsed[1], whole, kind=kind,
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
            if callable(getattr(module, "finish_init", None)) and key_for_path(path) is None:
                unplanned[Unplanned(_pattern(path), "takes a quant_recipe but the GPT adapter does not plan "
                                                    "it (not a decoder layer's attention or dense MLP linear)")] = None
    order = {name: i for i, name in enumerate((MTP_EH_PROJ.name,) + NAMES)}
    # modules register proj before qkv; MTP layers come after the decoder
    found.sort(key=lambda e: (is_mtp(e.key), e.layer, order[e.key.name.removeprefix(MTP)]
                              if e.key.name != MTP_EH_PROJ.name else -1))
    return Inventory(FAMILY, found, unplanned)


# -- layer specs: which spec fields hold the planned linears ---------------------------------------


def is_mla_spec(layer_spec) -> bool:
    """Whether a GPT layer spec builds multi-latent attention (its attention has MLA's fields)."""
    attention = _submodules(getattr(getattr(layer_spec, "submodules", None), "self_attention", None))
    return hasattr(attention, "linear_kv_down_proj")


def _spec_fields(column_cls, row_cls, duplicated_cls=None, mla: bool = False) -> dict[str, dict[str, object]]:
    """{layer submodule: {spec field: class}}, each planned linear's class by its parallel kind."""
    by_kind = {ParallelKind.COLUMN: column_cls, ParallelKind.ROW: row_cls,
               ParallelKind.DUPLICATED: column_cls if duplicated_cls is None else duplicated_cls}
    out: dict[str, dict[str, object]] = {}
    for s in (MLA_LINEARS + LINEARS[1:]) if mla else LINEARS:
        parent, leaf = s.suffix.split(".")
        out.setdefault(parent, {})[leaf] = by_kind[s.kind]
    return out


def _submodules(module_spec):
    if isinstance(module_spec, functools.partial):  # megatron-core >= 0.17 builds the MLP as a partial
        return module_spec.keywords.get("submodules")
    return getattr(module_spec, "submodules", None)


def spec_lacks(layer_spec) -> list[str]:
    """The planned linears (module suffixes) a GPT layer spec has no field for (a block spec,
    another attention): SNIP cannot plan such a spec."""
    lacking = []
    for parent, fields in _spec_fields(None, None, mla=is_mla_spec(layer_spec)).items():
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


def replace_duplicated_linears(layer_spec, cls):
    """A copy of an MLA layer spec whose down-projections (duplicated over TP in the TE spec) are
    `cls`; the other linears stay as they are."""
    spec = copy.deepcopy(layer_spec)
    attention = _submodules(spec.submodules.self_attention)
    for s in MLA_LINEARS:
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
        inner = next(name for name in MTP_INNER if hasattr(layer.submodules, name))  # by release
        setattr(layer.submodules, inner, layer_spec_fn(getattr(layer.submodules, inner)))
    return spec


def replace_planned_linears(layer_spec, column_cls, row_cls, duplicated_cls=None):
    """A copy of a GPT layer spec whose column-parallel planned linears are `column_cls`,
    row-parallel ones `row_cls` and MLA's down-projections `duplicated_cls` (default `column_cls`,
    as Megatron's local spec has them). megatron-core 0.16 builds the MLP as `ModuleSpec(MLP,
    submodules=MLPSubmodules)`, 0.17+ as `functools.partial(MLP.as_mlp_submodule, submodules=...)`."""
    spec = copy.deepcopy(layer_spec)
    for parent, fields in _spec_fields(column_cls, row_cls, duplicated_cls, mla=is_mla_spec(layer_spec)).items():
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
