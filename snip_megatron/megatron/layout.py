"""Every rank's planned linears for a model layout, without building the model.

Layers per pipeline stage / virtual chunk come from Megatron's own `get_num_layers_to_build` and
`get_transformer_layer_offset` (both take `pp_rank`, so no process group is needed), so uneven
splits (`--decoder-first/last-pipeline-num-layers`, embedding/loss accounting, custom layouts) are
Megatron's; module paths are the ones `GPTModel.named_modules()` gives. `pipeline_stages` maps
every layer to its pipeline rank (the per-stage budgets); the command that checks a whole layout
is `python -m snip_megatron.cli.layout`.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from snip_megatron.formats.precision import Precision
from snip_megatron.models import gpt
from snip_megatron.models.inventory import ParallelKind
from snip_megatron.plan import LayerKey, Plan, forward_order
from snip_megatron.shapes import ModelShape, get_shape


@dataclass(frozen=True)
class LinearSlot:
    """One planned linear on one rank."""

    key: LayerKey
    """Global layer number and linear name."""
    chunk: int
    """Model chunk on this rank (the virtual pipeline stage; 0 without VPP)."""
    module_path: str
    """Path inside the chunk's GPTModel, with the stage-local layer index."""
    local_shape: tuple[int, int]
    """(out_features, in_features) of this rank's weight shard."""


@dataclass(frozen=True)
class RankLayout:
    """A rank's coordinates and planned linears."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    layer_offsets: tuple[int, ...]
    """Global layers before each chunk (Megatron's layer offset), one per chunk."""
    linears: tuple[LinearSlot, ...]


def module_path(local_index: int, name: str) -> str:
    """The path Megatron gives a planned linear inside a GPTModel chunk."""
    return gpt.module_path(LayerKey(local_index + 1, name))


def layout_config(shape: ModelShape, *, tp: int = 1, pp: int = 1, vpp: "int | None" = None):
    """A TransformerConfig with the shape and split (a dataclass: no weights, no process group)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from snip_megatron.megatron.model import validate_layout

    validate_layout(shape, tp, pp, vpp)  # the builder's own checks: same errors as a real run
    if vpp is not None and pp < 2:
        raise ValueError(f"virtual_pipeline_model_parallel_size={vpp} needs "
                         f"pipeline_model_parallel_size >= 2, got {pp}")
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim,
        gated_linear_unit=True, add_bias_linear=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.bfloat16,
        params_dtype=torch.bfloat16, bf16=True)


def chunk_layers(config, pp_rank: int, vp_stage: "int | None") -> tuple[int, int]:
    """(layer offset, number of layers) of one pipeline chunk, by Megatron's own functions; of a
    custom layout (--pipeline-model-parallel-layout) from the layout itself, whose offset Megatron
    computes for the calling process's rank only (transformer_layer.py get_transformer_layer_offset
    does not pass `pp_rank` on, 0.19.2: lines 70-73)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None and config.pipeline_model_parallel_size > 1:
        from megatron.core.transformer.enums import LayerType

        chunks, stage = layout.layout, vp_stage or 0
        # PipelineParallelLayerLayout.get_layer_offset's sum, for any rank: every chunk before
        # (vp_stage, pp_rank) in the interleaved order
        offset = sum(chunks[p][v].count(LayerType.decoder) for v in range(stage + 1)
                     for p in range(config.pipeline_model_parallel_size if v < stage else pp_rank))
        return offset, chunks[pp_rank][stage].count(LayerType.decoder)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return int(offset), int(count)


def pipeline_stages(config) -> dict[LayerKey, int]:
    """LayerKey -> the pipeline rank that holds it, by Megatron's offsets (any split, with VPP)."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks

    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    keys = gpt.of_config(config).keys()
    # Megatron builds every MTP layer on one stage: the last, or where a custom layout puts them
    mtp_stage = max(get_mtp_ranks(list(range(pp)), config) or [pp - 1])
    stages = {key: mtp_stage for key in keys if gpt.is_mtp(key)}
    for pp_rank in range(pp):
        for vp_stage in (range(vpp) if vpp else [None]):
            offset, count = chunk_layers(config, pp_rank, vp_stage)
            layers = range(offset + 1, offset + count + 1)
            stages.update({key: pp_rank for key in keys if key.layer in layers and not gpt.is_mtp(key)})
    return stages


def rank_layout(shape: ModelShape, config, *, tp_rank: int, pp_rank: int, dp_rank: int = 0,
                dp: int = 1) -> RankLayout:
    """One rank's planned linears. Rank order is Megatron's default 'tp-cp-ep-dp-pp' (cp=ep=1)."""
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    inventory = gpt.inventory(shape)
    slots, offsets = [], []
    for chunk, vp_stage in enumerate(range(vpp) if vpp else [None]):
        offset, count = chunk_layers(config, pp_rank, vp_stage)
        offsets.append(offset)
        for e in inventory:
            if offset < e.layer <= offset + count:
                out_f, in_f = e.shape
                local_shape = (out_f // tp, in_f) if e.kind is ParallelKind.COLUMN else (out_f, in_f // tp)
                slots.append(LinearSlot(e.key, chunk, gpt.module_path(e.key, offset), local_shape))
    rank = tp_rank + tp * (dp_rank + dp * pp_rank)
    return RankLayout(rank, tp_rank, pp_rank, dp_rank, tuple(offsets), tuple(slots))


def enumerate_layout(shape: ModelShape, *, tp: int = 1, pp: int = 1, vpp: "int | None" = None,
                     dp: int = 1) -> list[RankLayout]:
    """Every rank's layout, in global rank order."""
    config = layout_config(shape, tp=tp, pp=pp, vpp=vpp)
    ranks = [rank_layout(shape, config, tp_rank=t, pp_rank=p, dp_rank=d, dp=dp)
             for p in range(pp) for d in range(dp) for t in range(tp)]
    return sorted(ranks, key=lambda r: r.rank)


def check_ownership(shape: ModelShape, ranks: list[RankLayout], tp: int) -> None:
    """Every LayerKey of the model is owned by exactly one (PP stage, chunk) and by every TP rank
    of it; nothing else is planned. ValueError naming the first offending key otherwise."""
    owners: dict[LayerKey, set] = defaultdict(set)
    tp_ranks: dict[tuple, set] = defaultdict(set)
    for r in ranks:
        for s in r.linears:
            owners[s.key].add((r.pp_rank, s.chunk))
            tp_ranks[(s.key, r.pp_rank, r.dp_rank)].add(r.tp_rank)
    expected = set(gpt.keys(shape.num_layers))
    if set(owners) != expected:
        missing = sorted(expected - set(owners), key=forward_order)
        extra = sorted(set(owners) - expected, key=forward_order)
        raise ValueError(f"layout does not cover the model: missing {missing[:4]}, extra {extra[:4]}")
    for key, where in owners.items():
        if len(where) != 1:
            raise ValueError(f"{key} is owned by {len(where)} pipeline chunks: {sorted(where)}")
    for (key, pp_rank, dp_rank), got in tp_ranks.items():
        if got != set(range(tp)):
            raise ValueError(f"{key} on pp stage {pp_rank} (dp {dp_rank}) is on TP ranks "
                             f"{sorted(got)}, expected all of 0..{tp - 1}")


def random_plan(num_layers: int, seed: int = 0) -> Plan:
    rng = random.Random(seed)
    return Plan({k: rng.choice(list(Precision)) for k in gpt.keys(num_layers)})


def roundtrip_plan(plan: Plan, ranks: list[RankLayout]) -> Plan:
    """Each rank resolves its linears' precisions through its own matcher, exactly as
    GPTModel.__init__ does (`get_quant_config_or_none(path, recipe)`); the union of what the
    ranks got is returned. ValueError if two ranks disagree on a key."""
    from megatron.core.quantization.utils import get_quant_config_or_none

    from snip_megatron.megatron.quant_recipe import build_recipe

    seen: dict[LayerKey, Precision] = {}
    for r in ranks:
        recipes = [build_recipe(plan, layer_offset=off) for off in r.layer_offsets]
        for s in r.linears:
            qc = get_quant_config_or_none(s.module_path, recipes[s.chunk])
            got = Precision.parse(qc.config["precision"])
            if seen.setdefault(s.key, got) is not got:
                raise ValueError(f"ranks disagree on {s.key}: {seen[s.key]} vs {got}")
    return Plan(seen)


def describe(r: RankLayout, verbose: bool = False) -> str:
    chunks = []
    for c, off in enumerate(r.layer_offsets):
        layers = sorted({s.key.layer for s in r.linears if s.chunk == c})
        chunks.append(f"{layers[0]}-{layers[-1]}" if layers else "none")
    line = (f"rank {r.rank:4d} tp={r.tp_rank} pp={r.pp_rank} dp={r.dp_rank} "
            f"layers {' | '.join(chunks)} linears={len(r.linears)}")
    if verbose:
        line += "".join(f"\n    chunk {s.chunk} {s.module_path:45s} {str(s.key):18s} "
                        f"{s.local_shape[0]}x{s.local_shape[1]}" for s in r.linears)
    return line
