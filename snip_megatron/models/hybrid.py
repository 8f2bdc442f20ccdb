"""HybridModel adapter (`--hybrid-layer-pattern`): every pattern symbol is its own layer.

`*` attention layer (self_attention.linear_qkv, linear_proj), `-` MLP layer (mlp.linear_fc1,
linear_fc2), `M` Mamba layer (mixer.in_proj, out_proj), `G` gated delta net (self_attention.in_proj,
out_proj), `E` MoE layer (MoETransformerLayer: its routed experts as the GPT adapter's units
`expert_fc1`/`expert_fc2` at mlp.experts.linear_fc1/2, TE's grouped linears, and its shared experts
if any; the router is never planned); `|` cuts pipeline segments. Layer i of a segment has
`layer_number = i + 1 + offset`, the offset being the layers of the segments before it (Megatron's
`select_pipeline_segment`). MLA (`+`), DSA (`D`) and MTP (`/`) layers are refused by name until
SNIP plans them here. An attention layer's keys are a GPT layer's (GPT layer L is hybrid layers
2L-1 and 2L of `*-*-...`). Pure: the pattern and the config's widths give the inventory; Megatron is not imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from snip_megatron.models import gpt
from snip_megatron.models.gpt import LinearSlot
from snip_megatron.models.inventory import Inventory, InventoryEntry, ParallelKind, Unplanned
from snip_megatron.models.keys import LayerKey
from snip_megatron.shapes import ModelShape

FAMILY = "hybrid"
PIPE = "|"
MOE = "E"

LINEARS: dict[str, tuple[LinearSlot, ...]] = {
    # an attention layer and an MLP layer are the two halves of a GPT layer, with its names
    "*": tuple(s for s in gpt.LINEARS if s.suffix.startswith("self_attention.")),
    "-": tuple(s for s in gpt.LINEARS if s.suffix.startswith("mlp.")),
    "M": (LinearSlot("in_proj", "mixer.in_proj", ParallelKind.COLUMN),
          LinearSlot("out_proj", "mixer.out_proj", ParallelKind.ROW)),
    "G": (LinearSlot("in_proj", "self_attention.in_proj", ParallelKind.COLUMN),
          LinearSlot("out_proj", "self_attention.out_proj", ParallelKind.ROW)),
    # the GPT adapter's MoE linears; a layer has its shared experts only if the config has them
    MOE: gpt.MOE_LINEARS,
}
"""Each planned layer symbol's linears, in forward order (an MoE layer's: `layer_slots`)."""
LAYER_NAMES = {"*": "attention", "-": "MLP", "M": "Mamba", "G": "gated delta net", MOE: "MoE"}
REFUSED = {
    "+": "multi-latent attention layers (+): SNIP plans MLA on GPTModel (snip-pretrain-gpt "
         "--multi-latent-attention), not yet as hybrid layers; use '*' attention layers",
    "D": "DeepSeek sparse attention layers (D): SNIP does not plan DSA yet; use '*' attention layers",
    "/": "multi-token prediction ('/' in the pattern): SNIP does not plan MTP layers yet; drop the "
         "'/...' part of the pattern",
}
NAMES = tuple(dict.fromkeys(s.name for slots in LINEARS.values() for s in slots))
"""Every linear name a hybrid layer can have, in forward order within a layer."""

UNPLANNED = (
    Unplanned("embedding", "embeddings stay in BF16"),
    Unplanned("decoder.layers.*.input_layernorm", "norms stay in BF16"),
    Unplanned("decoder.layers.*.mixer.conv1d", "Mamba's convolution and SSM scan stay in BF16/FP32"),
    Unplanned("decoder.layers.*.self_attention.core_attention", "the attention core stays in BF16"),
    Unplanned("decoder.final_norm", "norms stay in BF16"),
    Unplanned("output_layer", "the output layer stays in BF16"),
)

_SUFFIX = {s.suffix: s for slots in LINEARS.values() for s in slots}
_PATH = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.(" + "|".join(re.escape(s) for s in _SUFFIX) + r")$")


@dataclass(frozen=True, kw_only=True)
class HybridDims:
    """The widths of Mamba and gated-delta-net layers (Megatron's TransformerConfig fields)."""

    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: "int | None" = None
    """None: hidden_size * mamba_expand / mamba_head_dim."""
    mamba_expand: int = 2
    """MambaMixer's `expand` (2 in Megatron's hybrid spec)."""
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32

    @classmethod
    def of(cls, config) -> "HybridDims":
        """The dims of a TransformerConfig (or anything with its field names)."""
        fields = {f: getattr(config, f) for f in cls.__dataclass_fields__ if getattr(config, f, None) is not None}
        return cls(**fields)


def parse_pattern(pattern: str) -> tuple[str, ...]:
    """The pipeline segments of a hybrid layer pattern ('|' cuts them), each a string of layer
    symbols; ValueError naming each symbol SNIP cannot plan, or does not know."""
    if not isinstance(pattern, str) or not pattern.replace(PIPE, ""):
        raise ValueError(f"--hybrid-layer-pattern {pattern!r} has no layers")
    refused = [REFUSED[c] for c in dict.fromkeys(pattern) if c in REFUSED]
    if refused:
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: " + "; ".join(refused))
    unknown = sorted({c for c in pattern if c not in LINEARS and c != PIPE})
    if unknown:
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: unknown layer symbol(s) {', '.join(unknown)}; "
                         f"SNIP plans {', '.join(f'{s} ({n})' for s, n in LAYER_NAMES.items())}")
    return tuple(pattern.split(PIPE))


def layer_symbols(pattern: str) -> str:
    """The pattern's layers in order (symbol i is global layer i + 1)."""
    return "".join(parse_pattern(pattern))


def segment(pattern: str, pp_rank: int = 0, pp: int = 1, vp_stage: "int | None" = None) -> tuple[int, str]:
    """(layer offset, layer symbols) of one pipeline chunk, as Megatron's `select_pipeline_segment`
    selects it: segment vp_stage * pp + pp_rank of the '|'-cut pattern, or without '|' an even
    split over `pp` stages."""
    segments = parse_pattern(pattern)
    if len(segments) == 1 and pp > 1:
        if vp_stage is not None:
            raise ValueError("virtual pipelining needs '|' in --hybrid-layer-pattern to cut its chunks")
        if len(segments[0]) % pp:
            raise ValueError(f"{len(segments[0])} layers do not split evenly over {pp} pipeline stages; "
                             "cut the pattern with '|'")
        per = len(segments[0]) // pp
        return pp_rank * per, segments[0][pp_rank * per:(pp_rank + 1) * per]
    if len(segments) > 1 and len(segments) % pp:
        raise ValueError(f"--hybrid-layer-pattern has {len(segments)} '|' segments, not a multiple of "
                         f"{pp} pipeline stages")
    index = (vp_stage or 0) * pp + pp_rank
    if index >= len(segments):
        raise ValueError(f"pipeline chunk {index} (pp_rank={pp_rank}, vp_stage={vp_stage}) is beyond the "
                         f"pattern's {len(segments)} segments")
    return sum(len(s) for s in segments[:index]), segments[index]


def chunk_offset(pattern: str, pp_group, vp_stage: "int | None" = None) -> int:
    """The global layers before the chunk this pipeline rank builds: `segment` at the rank and size
    of Megatron's pipeline group (`pg_collection.pp`; None: one stage)."""
    rank, size = (pp_group.rank(), pp_group.size()) if pp_group is not None else (0, 1)
    return segment(pattern, rank, size, vp_stage)[0]


def stage_of_layers(pattern: str, pp: int, vpp: "int | None" = None) -> dict[int, int]:
    """Global layer number -> pipeline stage (the per-stage budgets), by `segment`; `vpp` default:
    the pattern's segments per stage beyond one (Megatron-LM derives the virtual pipeline from them,
    training/arguments.py validate_args, 0.19.2)."""
    if vpp is None and pp > 1:
        segments = len(parse_pattern(pattern))
        vpp = segments // pp if segments > pp else None
    out = {}
    for vp_stage in range(vpp) if vpp else [None]:
        for pp_rank in range(pp):
            offset, symbols = segment(pattern, pp_rank, pp, vp_stage)
            out.update({offset + i + 1: pp_rank for i in range(len(symbols))})
    return out


def layer_slots(symbol: str, moe: "gpt.MoEDims | None" = None) -> tuple[LinearSlot, ...]:
    """The planned linears of a layer of `symbol`, in forward order (an MoE layer's from `moe`)."""
    if symbol != MOE:
        return LINEARS[symbol]
    if moe is None:
        raise ValueError("--hybrid-layer-pattern has MoE (E) layers but the model has no experts "
                         "(num_moe_experts / --num-experts)")
    return moe.slots()


def linear_shapes(shape: ModelShape, dims: HybridDims = HybridDims(),
                  moe: "gpt.MoEDims | None" = None) -> dict[str, dict[str, tuple[int, int]]]:
    """{symbol: {linear name: (out_features, in_features)}}, unsharded (an MoE layer's, with `moe`:
    one expert's for a routed-expert unit)."""
    h = shape.hidden_size
    dense = gpt.linear_shapes(shape, moe=moe)
    d_inner = (dims.mamba_num_heads * dims.mamba_head_dim if dims.mamba_num_heads
               else dims.mamba_expand * h)
    nheads = d_inner // dims.mamba_head_dim
    qk, v = dims.linear_key_head_dim * dims.linear_num_key_heads, dims.linear_value_head_dim * dims.linear_num_value_heads
    return {
        "*": {s.name: dense[s.name] for s in LINEARS["*"]},
        "-": {s.name: dense[s.name] for s in LINEARS["-"]},
        # MambaMixer's in_proj packs z, x, B, C, dt
        "M": {"in_proj": (2 * d_inner + 2 * dims.mamba_num_groups * dims.mamba_state_dim + nheads, h),
              "out_proj": (h, d_inner)},
        # GatedDeltaNet's in_proj packs q, k, v, z, beta, alpha
        "G": {"in_proj": (2 * qk + 2 * v + 2 * dims.linear_num_value_heads, h), "out_proj": (h, v)},
        MOE: {s.name: dense[s.name] for s in (moe.slots() if moe is not None else ())},
    }


def inventory(shape: ModelShape, pattern: str, dims: HybridDims = HybridDims(), *,
              moe: "gpt.MoEDims | None" = None, sequence_parallel: bool = False) -> Inventory:
    """Every planned linear of a HybridModel of `pattern` with `shape`'s widths (its MoE layers'
    experts `moe`; every `E` layer is an MoE layer, whatever moe_layer_freq says), without building it."""
    symbols = layer_symbols(pattern)
    if shape.num_layers != len(symbols):
        raise ValueError(f"the model has num_layers={shape.num_layers} but --hybrid-layer-pattern {pattern!r} "
                         f"has {len(symbols)} layers; they must agree")
    shapes = linear_shapes(shape, dims, moe)
    entries = []
    for i, symbol in enumerate(symbols):
        for slot in layer_slots(symbol, moe):
            out_in = shapes[symbol][slot.name]
            entries.append(gpt.entry(i + 1, slot.name, out_in, sequence_parallel=sequence_parallel, moe=moe)
                           if symbol == MOE else
                           InventoryEntry(LayerKey(i + 1, slot.name), slot.suffix, out_in, slot.kind,
                                          sequence_parallel and slot.kind is not ParallelKind.ROW))
    unplanned = UNPLANNED + (moe.unplanned() if MOE in symbols else ())
    return Inventory(FAMILY, entries, unplanned)


def parse_path(module_path: str) -> "tuple[int, str] | None":
    """(stage-local 0-based layer index, linear name) of a planned linear's module path, else None."""
    m = _PATH.search(module_path)
    return (int(m.group(1)), _SUFFIX[m.group(2)].name) if m else None


def key_for_path(module_path: str, layer_offset: int = 0) -> "LayerKey | None":
    """The global key of a module path in a chunk whose first layer is `layer_offset` + 1 (the
    suffix alone tells the layer kind: mixer.* is Mamba, self_attention.in_proj a GDN)."""
    parsed = parse_path(module_path)
    return None if parsed is None else LayerKey(layer_offset + parsed[0] + 1, parsed[1])


def module_path(entry: InventoryEntry, layer_offset: int = 0) -> str:
    """The path Megatron gives an inventory entry inside the chunk whose first layer is
    `layer_offset` + 1 (the entry's suffix names the layer kind, so no pattern is needed)."""
    local = entry.layer - layer_offset - 1
    if local < 0:
        raise ValueError(f"{entry.key} is not in a chunk starting after layer {layer_offset}")
    return f"decoder.layers.{local}.{entry.suffix}"


def module_pattern(key: LayerKey, pattern: str, layer_offset: int = 0) -> str:
    """The path of a plan key's module inside the chunk whose first layer is `layer_offset` + 1,
    its layer's kind read from `pattern` (a Mamba and a gated-delta-net layer both have in_proj);
    ValueError where that layer has no such linear."""
    symbols = layer_symbols(pattern)
    if not 1 <= key.layer <= len(symbols):
        raise ValueError(f"{key} is beyond --hybrid-layer-pattern {pattern!r} ({len(symbols)} layers)")
    symbol = symbols[key.layer - 1]
    slot = next((s for s in LINEARS[symbol] if s.name == key.name), None)
    if slot is None:
        raise ValueError(f"{key}: layer {key.layer} of --hybrid-layer-pattern {pattern!r} is a '{symbol}' layer "
                         f"({LAYER_NAMES[symbol]}), which has no {key.name}")
    return module_path(InventoryEntry(key, slot.suffix, (0, 0), slot.kind), layer_offset)


def module_paths(entry: InventoryEntry, layer_offset: int = 0) -> tuple[str, ...]:
    """The paths the modules of an entry can have in the chunk (one: a hybrid layer's linear has no
    local experts; the GPT adapter's expert units have two)."""
    return (module_path(entry, layer_offset),)


def is_model(chunk) -> bool:
    """Whether a built chunk (optionally inside DDP / Float16Module wrappers) is a HybridModel
    (Megatron's HybridModel and its MambaModel alias keep their `hybrid_layer_pattern`)."""
    while not hasattr(chunk, "hybrid_layer_pattern") and hasattr(chunk, "module"):
        chunk = chunk.module
    return isinstance(getattr(chunk, "hybrid_layer_pattern", None), str)


def planned_modules(chunk):
    """(module path, module, entry) of every planned linear of one built HybridModel chunk, in
    registration order; `entry`'s layer is the enclosing layer's `layer_number` (Megatron's
    `i + 1 + pp_layer_offset`), its whole shape the weight's times TP along the sharded dim."""
    for path, module in chunk.named_modules():
        m = _PATH.search(path)
        if m is None:
            continue
        layer_path = path[: m.start(2) - 1]
        number = getattr(chunk.get_submodule(layer_path), "layer_number", None)
        if not isinstance(number, int):
            raise ValueError(f"{layer_path!r} has no integer layer_number; not a HybridStack layer?")
        slot = _SUFFIX[m.group(2)]
        config = getattr(module, "config", None)
        tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        expert = slot in gpt.EXPERT_LINEARS
        if expert:  # experts are split over the expert TP group
            tp = int(getattr(config, "expert_tensor_parallel_size", None) or tp)
        out_f, in_f = (int(d) for d in gpt.gemm_weight(module).shape)  # a grouped linear: one expert's
        whole = (out_f * tp, in_f) if slot.kind is ParallelKind.COLUMN else (out_f, in_f * tp)
        sp = bool(getattr(config, "sequence_parallel", False))
        if slot in gpt.MOE_LINEARS:
            yield path, module, gpt.entry(number, slot.name, whole, sequence_parallel=sp,
                                          moe=gpt.MoEDims.of(config) if expert else None)
            continue
        yield path, module, InventoryEntry(LayerKey(number, slot.name), slot.suffix, whole, slot.kind,
                                           sp and slot.kind is not ParallelKind.ROW)


def discover(model_chunks) -> Inventory:
    """This rank's part of the inventory, read from its built HybridModel chunk(s): every module
    under `decoder.layers.<i>` at a planned layer's suffix that takes a quant_recipe through
    Megatron's `finish_init`. Other modules that take one (MTP, routers' experts) are listed as
    unplanned, never silently dropped."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    found, unplanned = [], dict.fromkeys(UNPLANNED)
    for chunk in chunks:
        planned = set()
        for path, module, e in planned_modules(chunk):
            planned.add(path)
            if callable(getattr(module, "finish_init", None)):
                found.append(e)
        for path, module in chunk.named_modules():
            if path.endswith("mlp.router"):  # an MoE layer's: never planned, as in the GPT adapter
                unplanned[gpt.MOE_ROUTER] = None
            if path.endswith("mlp.shared_experts") and getattr(module, "gate_weight", None) is not None:
                unplanned[gpt.SHARED_EXPERT_GATE] = None
            if callable(getattr(module, "finish_init", None)) and path not in planned:
                unplanned[Unplanned(re.sub(r"\.\d+(?=\.|$)", ".*", path),
                                    "takes a quant_recipe but the hybrid adapter does not plan it")] = None
    order = {name: i for i, name in enumerate(NAMES)}
    found.sort(key=lambda e: (e.layer, order[e.key.name]))  # modules may register out of forward order
    return Inventory(FAMILY, found, unplanned)
