"""GPTModel adapter: the planned linears of each TransformerLayer (dense attention, or
multi-latent attention with `--multi-latent-attention`) and its dense MLP or MoE layer (`--num-experts`:
routed experts and shared experts; `--moe-layer-freq` mixes dense and MoE layers).

The only place that names them. Keys are (global `TransformerLayer.layer_number`, linear name);
module paths inside a chunk use the layer index local to the pipeline stage / virtual chunk, so a
chunk's layer offset (Megatron's `get_transformer_layer_offset`) turns one into the other.
Megatron is never imported here (`discover` works on what Megatron built; the layer-spec helpers
are `models.gpt_spec`), so the pure parts of SNIP can use the rest.
"""

from __future__ import annotations

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


LINEARS = (  # the planned linears of one layer, in forward order
    LinearSlot("linear_qkv", "self_attention.linear_qkv", ParallelKind.COLUMN),
    LinearSlot("linear_proj", "self_attention.linear_proj", ParallelKind.ROW),
    LinearSlot("linear_fc1", "mlp.linear_fc1", ParallelKind.COLUMN),
    LinearSlot("linear_fc2", "mlp.linear_fc2", ParallelKind.ROW),
)
LINEAR_NAMES = tuple(s.name for s in LINEARS)

MLA_LINEARS = (
    LinearSlot("linear_q_proj", "self_attention.linear_q_proj", ParallelKind.COLUMN),
    LinearSlot("linear_q_down_proj", "self_attention.linear_q_down_proj", ParallelKind.DUPLICATED),
    LinearSlot("linear_kv_down_proj", "self_attention.linear_kv_down_proj", ParallelKind.DUPLICATED),
    LinearSlot("linear_q_up_proj", "self_attention.linear_q_up_proj", ParallelKind.COLUMN),
    LinearSlot("linear_kv_up_proj", "self_attention.linear_kv_up_proj", ParallelKind.COLUMN),
)
"""Multi-latent attention's projections before its core, in forward order (linear_q_proj without
q_lora_rank). The TE spec builds the down-projections as TELinear(parallel_mode="duplicated"); the
local spec as ColumnParallelLinear (SNIP's specs duplicate them as TE does): `module_kind` reads it."""
MLA_DOWN = tuple(s.name for s in MLA_LINEARS if s.kind is ParallelKind.DUPLICATED)
EXPERT_LINEARS = (
    LinearSlot("expert_fc1", "mlp.experts.linear_fc1", ParallelKind.COLUMN),
    LinearSlot("expert_fc2", "mlp.experts.linear_fc2", ParallelKind.ROW),
)
"""An MoE layer's routed experts: one planned unit per linear and layer, all its experts together
(TE's grouped module, or SequentialMLP's `mlp.experts.local_experts.<i>.linear_fc1/2`)."""
SHARED_EXPERT_LINEARS = (
    LinearSlot("shared_expert_fc1", "mlp.shared_experts.linear_fc1", ParallelKind.COLUMN),
    LinearSlot("shared_expert_fc2", "mlp.shared_experts.linear_fc2", ParallelKind.ROW),
)
"""An MoE layer's shared experts (`--moe-shared-expert-intermediate-size`): a dense MLP on every token."""
LATENT_LINEARS = (
    LinearSlot("fc1_latent_proj", "mlp.fc1_latent_proj", ParallelKind.DUPLICATED),
    LinearSlot("fc2_latent_proj", "mlp.fc2_latent_proj", ParallelKind.DUPLICATED),
)
"""An MoE layer's latent projections (`--moe-latent-size`): TE linears duplicated over TP, to the
experts' latent width and back (megatron/core/transformer/moe/moe_layer.py, 0.19.2: 265-296)."""
MOE_LINEARS = EXPERT_LINEARS + SHARED_EXPERT_LINEARS + LATENT_LINEARS
NAMES = ("linear_qkv",) + tuple(s.name for s in MLA_LINEARS) + LINEAR_NAMES[1:] + tuple(
    s.name for s in (LATENT_LINEARS[0], *EXPERT_LINEARS, LATENT_LINEARS[1], *SHARED_EXPERT_LINEARS))
"""Every linear name a GPT layer can have, in forward order (a layer has a dense MLP or an MoE layer)."""
INPUT_READ_BY_ANOTHER = ("linear_kv_down_proj", "shared_expert_fc1")  # inputs kept anyway: stats/scale_bytes.py
MTP = "mtp."
"""Multi-token prediction's prefix: key (depth k, "mtp.<name>") names linear <name> of MTP layer k
(Megatron numbers them 1..D again); MTP keys sort after every decoder key (models.order)."""
MTP_EH_PROJ = LinearSlot(MTP + "eh_proj", "eh_proj", ParallelKind.COLUMN)
"""An MTP layer's projection of [embedding; hidden] (2h -> h) before its inner layer."""
MTP_INNER = ("mtp_model_layer", "transformer_layer")
"""The inner transformer layer's module name: mtp_model_layer (megatron-core >= 0.17), transformer_layer (0.16)."""


def mtp_slots(mla: "MLADims | None" = None, moe: "MoEDims | None" = None) -> tuple[LinearSlot, ...]:
    """The planned linears of one MTP layer, in forward order: eh_proj, then its inner layer's (an
    MoE layer's with `moe`: Megatron builds the MTP layer from the last decoder layer's spec,
    megatron/core/models/gpt/gpt_layer_specs.py get_gpt_mtp_block_spec_for_backend)."""
    return (MTP_EH_PROJ,) + tuple(LinearSlot(MTP + s.name, s.suffix, s.kind) for s in layer_slots(mla, moe))


def is_mtp(key: LayerKey) -> bool:
    """Whether `key` names a linear of a multi-token-prediction layer."""
    return key.name.startswith(MTP)


SLOTS = {s.name: s for s in LINEARS + MLA_LINEARS + MOE_LINEARS}
SLOTS.update({MTP + s.name: LinearSlot(MTP + s.name, s.suffix, s.kind) for s in LINEARS + MLA_LINEARS + MOE_LINEARS})
SLOTS[MTP_EH_PROJ.name] = MTP_EH_PROJ
EXPERT_NAMES = tuple(s.name for s in EXPERT_LINEARS)


def is_expert_name(name: str) -> bool:
    """Whether a linear name is a routed-expert unit's, in the decoder or an MTP layer."""
    return name.removeprefix(MTP) in EXPERT_NAMES


def is_expert(key: LayerKey) -> bool:
    """Whether `key` names an MoE layer's routed-expert unit (a decoder's or an MTP layer's)."""
    return is_expert_name(key.name)

UNPLANNED = (
    Unplanned("embedding", "embeddings stay in BF16"),
    Unplanned("decoder.layers.*.input_layernorm", "norms stay in BF16"),
    Unplanned("decoder.layers.*.pre_mlp_layernorm", "norms stay in BF16"),
    Unplanned("decoder.layers.*.self_attention.core_attention", "the attention core stays in BF16"),
    Unplanned("decoder.final_layernorm", "norms stay in BF16"),
    Unplanned("output_layer", "the output layer stays in BF16"),
)
MOE_ROUTER = Unplanned("decoder.layers.*.mlp.router", "the MoE router stays in high precision: Megatron gives "
                       "it no quant_recipe (--moe-router-dtype sets its dtype)")
SHARED_EXPERT_GATE = Unplanned("decoder.layers.*.mlp.shared_experts.gate_weight",
                               "the shared-expert gate stays in high precision (a bare weight, no quant_recipe)")

# A planned linear inside a GPTModel chunk (optionally under DDP's `module.`); a routed expert's
# linear is the grouped module (`mlp.experts.linear_fc1`) or one local expert's
# (`mlp.experts.local_experts.<i>.linear_fc1`, SequentialMLP). MTP layers (`mtp.layers...`) do not match.
_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def _suffix_pattern(suffix: str) -> str:
    if suffix in (s.suffix for s in EXPERT_LINEARS):
        parent, leaf = suffix.rsplit(".", 1)
        return re.escape(parent) + r"\.(?:local_experts\.\d+\.)?" + re.escape(leaf)
    return re.escape(suffix)


_PATH = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.(" + "|".join(dict.fromkeys(
    _suffix_pattern(s.suffix) for s in SLOTS.values())) + r")$")
_NAME_OF_SUFFIX = {s.suffix: s.name for s in LINEARS + MLA_LINEARS + MOE_LINEARS}
_MTP_PATH = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.(?:(?:" + "|".join(MTP_INNER) + r")\.("
                       + "|".join(dict.fromkeys(_suffix_pattern(s.suffix) for s in LINEARS + MLA_LINEARS + MOE_LINEARS))
                       + r")|(eh_proj))$")


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


@dataclass(frozen=True, kw_only=True)
class MoEDims:
    """An MoE GPT's experts (Megatron's TransformerConfig MoE fields)."""

    num_experts: int
    """num_moe_experts."""
    topk: int
    """moe_router_topk: experts each token is routed to."""
    ffn_hidden_size: int
    """moe_ffn_hidden_size: one expert's hidden width."""
    shared_ffn_hidden_size: "int | None" = None
    """moe_shared_expert_intermediate_size: the shared experts' width (None: no shared experts)."""
    shared_gate: bool = False
    """moe_shared_expert_gate."""
    layer_freq: "int | tuple[int, ...]" = 1
    """moe_layer_freq: every n-th layer is MoE (from the first), or one 0/1 per layer."""
    latent_size: "int | None" = None
    """moe_latent_size: the experts' latent width (None: the hidden size, no latent projections)."""

    @classmethod
    def of(cls, config) -> "MoEDims | None":
        """The experts of a TransformerConfig with num_moe_experts (None without)."""
        experts = getattr(config, "num_moe_experts", None)
        if not experts:
            return None
        freq = getattr(config, "moe_layer_freq", 1)
        return cls(num_experts=int(experts), topk=int(getattr(config, "moe_router_topk", 2)),
                   ffn_hidden_size=int(getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size),
                   shared_ffn_hidden_size=getattr(config, "moe_shared_expert_intermediate_size", None) or None,
                   shared_gate=bool(getattr(config, "moe_shared_expert_gate", False)),
                   layer_freq=freq if isinstance(freq, int) else tuple(int(f) for f in freq),
                   latent_size=getattr(config, "moe_latent_size", None) or None)

    def config_fields(self) -> dict:
        """The TransformerConfig fields of these experts (the inverse of `of`)."""
        freq = self.layer_freq if isinstance(self.layer_freq, int) else list(self.layer_freq)
        return dict(num_moe_experts=self.num_experts, moe_router_topk=self.topk,
                    moe_ffn_hidden_size=self.ffn_hidden_size,
                    moe_shared_expert_intermediate_size=self.shared_ffn_hidden_size,
                    moe_shared_expert_gate=self.shared_gate, moe_layer_freq=freq,
                    **({"moe_latent_size": self.latent_size} if self.latent_size else {}))

    def is_moe_layer(self, layer: int, num_layers: int) -> bool:
        """Whether 1-based decoder layer `layer` of `num_layers` is an MoE layer (Megatron's
        `get_gpt_decoder_layer_specs` reading moe_layer_freq)."""
        if isinstance(self.layer_freq, int):
            return (layer - 1) % self.layer_freq == 0
        if len(self.layer_freq) != num_layers:
            raise ValueError(f"moe_layer_freq lists {len(self.layer_freq)} layers, the model has {num_layers}")
        return bool(self.layer_freq[layer - 1])

    def slots(self) -> tuple[LinearSlot, ...]:
        """An MoE layer's planned linears after attention, in forward order (the latent projections
        around the experts; the shared experts after them, MoELayer.forward's order)."""
        experts = (LATENT_LINEARS[0], *EXPERT_LINEARS, LATENT_LINEARS[1]) if self.latent_size else EXPERT_LINEARS
        return experts + (SHARED_EXPERT_LINEARS if self.shared_ffn_hidden_size else ())

    def unplanned(self) -> tuple[Unplanned, ...]:
        return (MOE_ROUTER,) + ((SHARED_EXPERT_GATE,) if self.shared_ffn_hidden_size and self.shared_gate else ())


PRESET_MOE = {"llama_tiny_moe": MoEDims(num_experts=4, topk=2, ffn_hidden_size=176, layer_freq=2),
              "llama_tiny_moe8": MoEDims(num_experts=8, topk=2, ffn_hidden_size=176, layer_freq=1)}
"""The experts of the model presets that have them (snip_megatron.shapes.PRESETS): layers 1, 3, 5 of
llama_tiny_moe, every layer of llama_tiny_moe8."""


def layer_slots(mla: "MLADims | None" = None, moe: "MoEDims | None" = None) -> tuple[LinearSlot, ...]:
    """The planned linears of one layer, in forward order (dense attention without `mla`; a dense
    MLP without `moe`, the MoE layer's linears with it)."""
    attention = LINEARS[:2] if mla is None else mla.attention_slots() + LINEARS[1:2]
    return attention + (LINEARS[2:] if moe is None else moe.slots())


PRESET_MLA = {"llama_tiny_mla": MLADims(q_lora_rank=64, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16,
                                         v_head_dim=32)}
"""The multi-latent attention of the model presets that have it (snip_megatron.shapes.PRESETS)."""


def parse_path(module_path: str) -> "tuple[int, str] | None":
    """(stage-local 0-based layer index, linear name) of a decoder layer's planned linear's module
    path, else None (MTP linears: `parse_mtp_path`)."""
    m = _PATH.search(module_path)
    return (int(m.group(1)), _NAME_OF_SUFFIX[_LOCAL_EXPERT.sub("", m.group(2))]) if m else None


def expert_index(module_path: str) -> "int | None":
    """The local expert index of one SequentialMLP expert's linear (`...local_experts.<i>.linear_fc1`,
    in a decoder or an MTP layer), else None."""
    m = _PATH.search(module_path) or _MTP_PATH.search(module_path)
    e = _LOCAL_EXPERT.search(m.group(2) or "") if m else None
    return int(e.group(1)) if e else None


def parse_mtp_path(module_path: str) -> "LayerKey | None":
    """The key of an MTP layer's planned linear ("mtp.layers.<k-1>....": depth k), else None."""
    m = _MTP_PATH.search(module_path)
    if m is None:
        return None
    name = MTP_EH_PROJ.name if m.group(3) else MTP + _NAME_OF_SUFFIX[_LOCAL_EXPERT.sub("", m.group(2))]
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


def module_path(key: "LayerKey | InventoryEntry", layer_offset: int = 0) -> str:
    """The path Megatron gives `key` (or an inventory entry's) inside the chunk whose first layer
    is `layer_offset` + 1."""
    key = getattr(key, "key", key)
    if is_mtp(key) and key.name in SLOTS:
        slot = SLOTS[key.name]
        inner = "" if slot is MTP_EH_PROJ else MTP_INNER[0] + "."
        return f"mtp.layers.{key.layer - 1}.{inner}{slot.suffix}"
    local = key.layer - layer_offset - 1
    if local < 0 or key.name not in SLOTS:
        raise ValueError(f"{key} is not a planned linear of a GPT chunk starting after layer {layer_offset}")
    return f"decoder.layers.{local}.{SLOTS[key.name].suffix}"


def module_paths(key: "LayerKey | InventoryEntry", layer_offset: int = 0) -> tuple[str, ...]:
    """The paths the modules of `key`'s unit (or an inventory entry's) can have in the chunk:
    `module_path`, and for an expert unit also its first local expert's (the SequentialMLP path)."""
    key = getattr(key, "key", key)
    path = module_path(key, layer_offset)
    if not is_expert(key):
        return (path,)
    parent, leaf = path.rsplit(".", 1)
    return path, f"{parent}.local_experts.0.{leaf}"


def module_pattern(key: LayerKey, layer_offset: int = 0) -> str:
    """A glob (fnmatch, as Megatron's GlobMatcher reads it) matching every module of `key`'s unit
    in the chunk: its path, or for an expert unit the grouped module and every local expert."""
    path = module_path(key, layer_offset)
    if not is_expert(key):
        return path
    parent, leaf = path.rsplit(".", 1)
    return f"{parent}.*{leaf}"


def linear_shapes(shape: ModelShape, mla: "MLADims | None" = None,
                  moe: "MoEDims | None" = None) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each planned linear of a layer, unsharded (an expert unit's:
    one expert's; with `moe`, an MoE layer's linears besides a dense layer's)."""
    h, n = shape.hidden_size, shape.num_attention_heads
    qkv_out = (n + 2 * shape.num_query_groups) * shape.head_dim
    gates = 2 if shape.gated_linear_unit else 1  # SwiGLU: gate and up
    out = {
        "linear_qkv": (qkv_out, h),
        "linear_proj": (h, n * shape.head_dim),
        "linear_fc1": (gates * shape.ffn_hidden_size, h),
        "linear_fc2": (h, shape.ffn_hidden_size),
    }
    if moe is not None:
        width = moe.latent_size or h  # the experts' width: latent with latent projections
        out["expert_fc1"], out["expert_fc2"] = (gates * moe.ffn_hidden_size, width), (width, moe.ffn_hidden_size)
        if moe.latent_size:
            out["fc1_latent_proj"], out["fc2_latent_proj"] = (moe.latent_size, h), (h, moe.latent_size)
        if moe.shared_ffn_hidden_size:
            shared = moe.shared_ffn_hidden_size
            out["shared_expert_fc1"], out["shared_expert_fc2"] = (gates * shared, h), (h, shared)
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
    names = [s.name for s in layer_slots(mla)] + ([s.name for s in moe.slots()] if moe is not None else [])
    return {name: {**out, **mla_shapes}[name] for name in names}


def keys(num_layers: int, mla: "MLADims | None" = None) -> list[LayerKey]:
    """Every key of a GPT with `num_layers` layers, in forward order (no shape needed)."""
    return [LayerKey(layer, s.name) for layer in range(1, num_layers + 1) for s in layer_slots(mla)]


def entry(layer: int, name: str, out_in: tuple[int, int], *, sequence_parallel: bool = False,
          kind: "ParallelKind | None" = None, moe: "MoEDims | None" = None) -> InventoryEntry:
    """One planned linear's entry; an expert unit's counts `moe`'s experts and top-k."""
    slot = SLOTS[name]
    kind = slot.kind if kind is None else ParallelKind(kind)
    expert = is_expert_name(name)
    if expert and moe is None:
        raise ValueError(f"{layer}.{name} is a routed-expert unit: its entry needs the MoEDims")
    # Under SP a column-parallel linear gathers its token-sharded input itself, and a duplicated one
    # works on this rank's tokens; a row-parallel one reads the TP-sharded hidden dim of whole
    # sequences. Experts get their tokens from the dispatcher, never sequence-sharded.
    return InventoryEntry(LayerKey(layer, name), slot.suffix, (int(out_in[0]), int(out_in[1])), kind,
                          sequence_parallel and kind is not ParallelKind.ROW and not expert,
                          experts=moe.num_experts if expert else 0, topk=moe.topk if expert else 1)


def inventory(shape: ModelShape, *, sequence_parallel: bool = False, mla: "MLADims | None" = None,
              mtp_num_layers: int = 0, moe: "MoEDims | None" = None) -> Inventory:
    """Every planned linear of a GPT of `shape` (with multi-latent attention of `mla`, the MoE
    layers of `moe`, and `mtp_num_layers` multi-token-prediction layers after the decoder),
    without building it (the 70B layout in microseconds)."""
    shapes = linear_shapes(shape, mla, moe)
    shapes.update({MTP + name: out_in for name, out_in in shapes.items()})
    shapes[MTP_EH_PROJ.name] = (shape.hidden_size, 2 * shape.hidden_size)
    L = shape.num_layers
    decoder = ((layer, s) for layer in range(1, L + 1)
               for s in layer_slots(mla, moe if moe is not None and moe.is_moe_layer(layer, L) else None))
    mtp_moe = moe if moe is not None and moe.is_moe_layer(L, L) else None  # the last decoder layer's kind
    mtp = ((depth, s) for depth in range(1, mtp_num_layers + 1) for s in mtp_slots(mla, mtp_moe))
    return Inventory(FAMILY, [entry(layer, s.name, shapes[s.name], sequence_parallel=sequence_parallel, moe=moe)
                              for layer, s in (*decoder, *mtp)],
                     UNPLANNED + (moe.unplanned() if moe is not None else ()))


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
                     moe=MoEDims.of(config),
                     sequence_parallel=bool(getattr(config, "sequence_parallel", False))
                     and int(getattr(config, "tensor_model_parallel_size", 1) or 1) > 1)


def _pattern(path: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


def gemm_weight(module):
    """One GEMM's weight of a planned linear: its `weight`, or for TE's grouped expert linear
    (`--moe-grouped-gemm`: `weight0..weight<n-1>`, one per local expert, all of one shape) `weight0`."""
    weight = getattr(module, "weight", None)
    return module.weight0 if weight is None and hasattr(module, "weight0") else module.weight


def grouped_expert_linears(experts) -> "tuple | None":
    """The two grouped linears (fc1, fc2) of Megatron's TEGroupedMLP (an MoE layer's `mlp.experts`
    with `--moe-grouped-gemm` on the TE spec); None for any other module."""
    fc1, fc2 = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
    if not (isinstance(getattr(fc1, "num_gemms", None), int) and hasattr(experts, "num_local_experts")):
        return None
    return fc1, fc2


def planned_modules(chunk):
    """(module path, module, entry) of every planned linear of one built chunk, in registration
    order; `entry` is the linear's inventory entry, its layer number the enclosing layer's
    `layer_number`, its whole shape its weight's times TP along the sharded dim (expert TP for
    experts). Every local expert of a SequentialMLP yields its own module, with its unit's entry."""
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
        slot = SLOTS[parsed[1]]
        expert = is_expert_name(slot.name)
        if expert:  # experts are split over the expert TP group
            tp = int(getattr(config, "expert_tensor_parallel_size", None) or tp)
        out_f, in_f = (int(d) for d in gemm_weight(module).shape)
        kind = module_kind(module) if slot.kind is ParallelKind.DUPLICATED else slot.kind
        whole = {ParallelKind.COLUMN: (out_f * tp, in_f), ParallelKind.ROW: (out_f, in_f * tp),
                 ParallelKind.DUPLICATED: (out_f, in_f)}[kind]
        yield path, module, entry(number, parsed[1], whole, kind=kind,
                                  sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
                                  moe=MoEDims.of(config) if expert else None)


def discover(model_chunks) -> Inventory:
    """This rank's part of the inventory, read from its built chunk(s) (one, or a list under VPP).

    A planned linear is a module under `decoder.layers.<i>` that takes a quant_recipe through
    Megatron's `finish_init` (TE linears and SNIP's emulated ones). Other modules that take one
    (MTP, experts) are listed as unplanned."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    found, unplanned = {}, dict.fromkeys(UNPLANNED)
    for chunk in chunks:
        for path, module, e in planned_modules(chunk):
            if callable(getattr(module, "finish_init", None)):
                if found.setdefault(e.key, e) != e:  # the local experts of one unit agree
                    raise ValueError(f"{path!r} differs from the other linears of {e.key}: {e} vs {found[e.key]}")
        for path, module in chunk.named_modules():
            if path.endswith("mlp.router"):
                unplanned[MOE_ROUTER] = None
            if path.endswith("mlp.shared_experts") and getattr(module, "gate_weight", None) is not None:
                unplanned[SHARED_EXPERT_GATE] = None
            if callable(getattr(module, "finish_init", None)) and key_for_path(path) is None:
                unplanned[Unplanned(_pattern(path), "takes a quant_recipe but the GPT adapter does not plan "
                                                    "it (not a decoder layer's attention or dense MLP linear)")] = None
    order = {name: i for i, name in enumerate((MTP_EH_PROJ.name,) + NAMES)}
    # modules register proj before qkv; MTP layers come after the decoder
    found = sorted(found.values(), key=lambda e: (is_mtp(e.key), e.layer, order[e.key.name.removeprefix(MTP)]
                                                  if e.key.name != MTP_EH_PROJ.name else -1))
    return Inventory(FAMILY, found, unplanned)
