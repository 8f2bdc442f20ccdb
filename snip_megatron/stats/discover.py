"""Find the planned linears of Megatron model chunks, keyed by LayerKey (global layer number)."""

from __future__ import annotations

from snip_megatron.plan import LayerKey


def _unwrap(chunk):
    # Megatron DDP / Float16Module wrap the GPTModel in `.module`
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def planned_linears(model_chunks) -> list[tuple[LayerKey, object]]:
    """[(LayerKey, module)] of this rank's planned linears, in forward order (found by the model
    family's adapter, `snip_megatron.megatron.apply.list_planned_linears`)."""
    from snip_megatron.megatron.apply import list_planned_linears

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [(pl.key, pl.module) for pl in list_planned_linears(list(chunks))]
