"""SnipLayerSpec: the `transformer_layer_spec` of Bridge's GPTModelProvider with SNIP in it.

`GPTModelProvider.provide()` calls its layer spec once per model chunk, with that chunk's
`vp_stage`, right before building it, and passes itself (the model config) to the model, whose
`finish_init` loop then reads `config.quant_recipe`. So SnipLayerSpec builds the user's spec with
SNIP's linears put in (emulated backend) and sets the recipe of the chunk about to be built (the
plan keyed by global layer, at that chunk's Megatron layer offset), exactly as the Megatron-LM
loop does (snip_megatron.pretrain.model). On the first chunk it starts the run's controller: the
config is final then (pretrain() applied the mixed-precision recipe) and process groups exist.

A dataclass with a module-level class, so Bridge can write it into each checkpoint's
run_config.yaml (the user's spec is recorded in it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SnipLayerSpec:
    """Bridge's layer spec with SNIP's planned linears and each chunk's quant_recipe."""

    user_spec: Any
    """The spec (or spec function) the model config had before `enable_snip`."""

    def __call__(self, config, vp_stage=None):
        from snip_megatron.bridge.run import active
        from snip_megatron.pretrain.model import merged_recipe, resolve_spec, with_planned_linears

        run = active(config)
        if run is None:
            raise RuntimeError("SnipLayerSpec builds models of the ConfigContainer enable_snip(cfg, snip) "
                               "was called on (one SNIP run per process); call enable_snip on this config")
        run.start(config)
        spec = resolve_spec(self.user_spec, config, vp_stage)
        check_emulated_spec(spec, run.backend)
        spec = with_planned_linears(spec, run.backend)
        config.quant_recipe = merged_recipe(run.controller.plan, config, vp_stage, backend=run.backend,
                                            formats=run.snip.formats, user_recipe=run.user_recipe,
                                            sm=None if run.te is None else run.te.sm)
        return spec


def check_emulated_spec(spec, backend: str) -> None:
    """The emulated backend replaces the planned linears of a local spec; a Transformer Engine
    spec fuses the attention norm into the layer's first linear (TELayerNormColumnParallelLinear),
    so replacing it would drop that norm: refused."""
    from snip_megatron.models import gpt

    if not hasattr(getattr(spec, "submodules", None), "self_attention"):
        return
    first = gpt.spec_linear_class(spec, gpt.first_linear_suffix())
    if backend == "emulated" and "transformer_engine" in getattr(first, "__module__", ""):
        raise ValueError(f"model.transformer_impl='local' (SNIP's emulated linears) with a Transformer "
                         f"Engine layer spec ({first.__name__}): set model.transformer_layer_spec="
                         "local_layer_spec, or model.transformer_impl='transformer_engine' for TE linears")


def spec_for_backend(user_spec, backend: str):
    """The spec SNIP builds on. Bridge's default spec is Transformer Engine's whatever
    `transformer_impl` says; the emulated backend (transformer_impl='local') takes Bridge's local
    spec instead. Any other spec is the user's, kept (its planned linears are replaced or planned)."""
    from megatron.bridge.models.gpt_provider import default_layer_spec, local_layer_spec

    if backend == "emulated" and user_spec is default_layer_spec:
        return local_layer_spec
    return user_spec
