"""FLOP table and pipeline-stage map: the weights of the planner's budget constraints."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from snip_megatron.models import gpt
from snip_megatron.models.inventory import Inventory
from snip_megatron.plan import LayerKey, parse_key
from snip_megatron.shapes import ModelShape


def flop_table(model: "ModelShape | Inventory", tokens: int | None = None) -> dict[LayerKey, float]:
    """FLOPs of one training step of every planned linear: fprop + dgrad + wgrad = 3 GEMMs of
    2*n*m*k each, so 6*n*m*k, with n tokens (default: one sequence, `shape.seq_length`), m x k the
    unsharded weight. Independent of TP: only ratios matter to the planner.

    `model`: the model's inventory, or the shape of a dense GPT (its inventory is built)."""
    if isinstance(model, ModelShape):
        n = model.seq_length if tokens is None else tokens
        model = gpt.inventory(model)
    elif tokens is None:
        raise ValueError("flop_table of an Inventory needs the tokens per step")
    else:
        n = tokens
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"tokens={tokens!r} must be a positive integer")
    return model.flop_table(n)


def stage_of_layers(num_layers: int, pp: int, vpp: int | None = None) -> dict[int, int]:
    """Global layer number (1-based) -> pipeline stage (0-based), Megatron's even split.

    Without VPP, stage s holds the s-th contiguous block of num_layers/pp layers. With VPP the model
    is cut into pp*vpp equal chunks and chunk c runs on stage c % pp (Megatron's interleaving)."""
    for name, v in (("num_layers", num_layers), ("pp", pp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    chunks = pp * (1 if vpp is None else vpp)
    if vpp is not None and (not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1):
        raise ValueError(f"vpp={vpp!r} must be None or a positive integer")
    if num_layers % chunks:
        raise ValueError(f"num_layers={num_layers} is not divisible by pp*vpp={chunks}; "
                         "uneven pipeline splits are not modelled")
    per_chunk = num_layers // chunks
    return {layer: ((layer - 1) // per_chunk) % pp for layer in range(1, num_layers + 1)}


def stages_for_keys(keys: Iterable, layer_stage: Mapping[int, int]) -> dict[LayerKey, int]:
    """LayerKey -> stage from a layer -> stage map (as `stage_of_layers` returns)."""
    out = {}
    for raw in keys:
        key = parse_key(raw)
        if key.layer not in layer_stage:
            raise ValueError(f"layer {key.layer} of {key} has no pipeline stage")
        out[key] = layer_stage[key.layer]
    return out


def validate_flops(flops: Mapping, keys: Iterable[LayerKey]) -> dict[LayerKey, float]:
    """The FLOPs of `keys`, checked positive and finite (ValueError names the layer)."""
    table = {parse_key(k): v for k, v in flops.items()}
    out = {}
    for key in keys:
        if key not in table:
            raise ValueError(f"layer {key} has no FLOP count")
        try:
            f = float(table[key])
        except (TypeError, ValueError):
            raise ValueError(f"FLOPs of layer {key} is not a number: {table[key]!r}") from None
        if not math.isfinite(f) or f <= 0:
            raise ValueError(f"FLOPs of layer {key} must be positive and finite, got {f}")
        out[key] = f
    return out
