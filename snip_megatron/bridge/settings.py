"""A Megatron-Bridge ConfigContainer as the Settings SNIP's support rules read (snip_megatron.support).

Bridge's configs are Megatron-Core's own (the model provider is a TransformerConfig, `ddp` and
`optimizer` are Megatron-Core's configs), so the rules read them as they are, with one step Bridge
takes when pretrain() starts: a mixed-precision recipe overwrites the model's, DDP's and
optimizer's fields of its names (MixedPrecisionConfig.setup), so the rules read copies with the
recipe applied, and name such a field as the recipe's. `refused` is run by `enable_snip` and again
on the final model config right before the model is built.
"""

from __future__ import annotations

import copy
import dataclasses
import os

BACKENDS = ("emulated", "te")
"""Planned-linear backends: SNIP's emulated linears (model.transformer_impl='local') or Megatron's
Transformer Engine linears planned through quant_recipe (model.transformer_impl='transformer_engine')."""


def backend_of(model) -> str:
    """emulated for Megatron's local layers, te for its Transformer Engine layers."""
    return "te" if getattr(model, "transformer_impl", None) == "transformer_engine" else "emulated"


def mixed_precision_of(cfg):
    """cfg.mixed_precision as a MixedPrecisionConfig (a recipe name resolved, cfg unchanged), or None."""
    mp = getattr(cfg, "mixed_precision", None)
    if isinstance(mp, str):
        from megatron.bridge.training.mixed_precision import get_mixed_precision_config

        return get_mixed_precision_config(mp)  # a fresh object: cfg keeps its string
    return mp


def is_hybrid(model) -> bool:
    """Whether a Bridge model config builds a HybridModel (HybridModelProvider, megatron-core 0.18+)."""
    try:
        from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    except ImportError:
        return False
    return isinstance(model, HybridModelProvider)


def family_of(model) -> str:
    """gpt (GPTModelProvider and its subclasses), hybrid, or the provider's class name."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    if is_hybrid(model):
        return "hybrid"
    return "gpt" if isinstance(model, GPTModelProvider) else type(model).__name__


def settings_of(cfg, snip, backend: "str | None" = None):
    """(Settings, BridgeNames) of a ConfigContainer: the configs as pretrain() will run them."""
    import torch

    from snip_megatron.support.names import BridgeNames
    from snip_megatron.support.settings import RunFacts, Settings
    from snip_megatron.te.installed import te_facts

    model, ddp, optimizer = (copy.copy(getattr(cfg, name, None)) for name in ("model", "ddp", "optimizer"))
    mp = mixed_precision_of(cfg)
    names = BridgeNames()
    if mp is not None:
        mp.setup(model, optimizer, ddp)
        recipe = cfg.mixed_precision if isinstance(cfg.mixed_precision, str) else "MixedPrecisionConfig"
        names = BridgeNames(recipe, frozenset(f.name for f in dataclasses.fields(mp)))
    comm = getattr(cfg, "comm_overlap", None)
    backend = backend or backend_of(model)
    facts = RunFacts(entry="bridge", family=family_of(model), backend=backend,
                     world_size=int(os.environ.get("WORLD_SIZE", "1")),
                     hybrid_pattern=(getattr(model, "hybrid_layer_pattern", None)
                                     or getattr(model, "hybrid_override_pattern", None)),
                     dataloader_type=getattr(getattr(cfg, "dataset", None), "dataloader_type", None),
                     peft=getattr(cfg, "peft", None) is not None,
                     full_te_layer=bool(getattr(model, "use_transformer_engine_full_layer_spec", False)),
                     comm_overlap_tp=bool(getattr(comm, "tp_comm_overlap", False)),
                     cuda=torch.cuda.is_available(), **te_facts(backend))
    settings = Settings(model=model, snip=snip, run=facts, ddp=ddp, optimizer=optimizer,
                        checkpoint=getattr(cfg, "checkpoint", None), dist=getattr(cfg, "dist", None))
    return settings, names


def refused(cfg, snip, backend: "str | None" = None, *, resolved: bool = False) -> list[str]:
    """Every setting of `cfg` this SNIP run cannot honour, one line each (empty: nothing to change)."""
    from snip_megatron.support.check import refusals

    settings, names = settings_of(cfg, snip, backend)
    return refusals(settings, names, resolved=resolved)


def check(cfg, snip, backend: "str | None" = None, *, resolved: bool = False) -> None:
    """ValueError listing every setting of `cfg` to change, if any (`resolved`: the rules on the
    SNIP config resolved for the backend and GPU)."""
    from snip_megatron.support.check import refusal_message

    lines = refused(cfg, snip, backend, resolved=resolved)
    if lines:
        raise ValueError(refusal_message("this Megatron-Bridge run cannot take SNIP as configured", lines))
