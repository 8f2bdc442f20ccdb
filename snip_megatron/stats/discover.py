"""Find the planned linears of Megatron model chunks, keyed by LayerKey (global layer number)."""

from __future__ import annotations

from snip_megatron.plan import LINEAR_NAMES, LayerKey, forward_order


def _unwrap(chunk):
    # Megatron DDP / Float16Module wrap the GPTModel in `.module`
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def planned_linears(model_chunks) -> list[tuple[LayerKey, object]]:
    """[(LayerKey, module)] of this rank's planned linears, in forward order.

    Uses engineer C's `snip_megatron.megatron.apply.list_planned_linears` when present; else walks
    `named_modules()` and reads `layer_number` of the enclosing TransformerLayer."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    try:
        from snip_megatron.megatron.apply import list_planned_linears
    except Exception:
        list_planned_linears = None
    if list_planned_linears is not None:
        return sorted(((LayerKey(*pl.key), pl.module) for pl in list_planned_linears(list(chunks))),
                      key=lambda km: forward_order(km[0]))
    out = []
    for chunk in chunks:
        chunk = _unwrap(chunk)
        for layer in chunk.decoder.layers:
            for name, module in layer.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if leaf in LINEAR_NAMES:
                    out.append((LayerKey(int(layer.layer_number), leaf), module))
    return sorted(out, key=lambda km: forward_order(km[0]))
