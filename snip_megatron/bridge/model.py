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


@dataclass
class SnipHybridStackSpec:
    """HybridModelProvider's `hybrid_stack_spec` with each chunk's quant_recipe (a HybridModel run).

    `HybridModelProvider.provide()` resolves its stack spec right before it builds the chunk and
    passes itself (the model config) to HybridModel, whose TE linears read `config.quant_recipe` as
    they are built and again in its post-init loop. So this sets the recipe of the chunk about to be
    built, at the layer offset Megatron's `select_pipeline_segment` gives this pipeline rank, exactly as
    snip-pretrain-hybrid does (pretrain.model.snip_hybrid_builder); the spec is the user's (None:
    Bridge's default, Megatron's TE-only hybrid stack spec) as it is. On the first chunk it starts
    the run's controller."""

    user_spec: Any
    """The stack spec (or spec function; None: Bridge's default) the model config had before `enable_snip`."""

    def __call__(self, config):
        import inspect

        from megatron.bridge.models.hybrid.hybrid_provider import get_default_hybrid_stack_spec
        from megatron.core.transformer.spec_utils import ModuleSpec

        from snip_megatron.bridge.run import active, hybrid_pattern
        from snip_megatron.models import hybrid
        from snip_megatron.pretrain.model import merged_recipe

        run = active(config)
        if run is None:
            raise RuntimeError("SnipHybridStackSpec builds models of the ConfigContainer enable_snip(cfg, snip) "
                               "was called on (one SNIP run per process); call enable_snip on this config")
        run.start(config)
        spec = self.user_spec
        if spec is None:
            spec = get_default_hybrid_stack_spec(config)
        elif not isinstance(spec, ModuleSpec):
            spec = spec(config) if inspect.signature(spec).parameters else spec()
        offset = hybrid.chunk_offset(hybrid_pattern(config), config._pg_collection.pp)
        config.quant_recipe = merged_recipe(run.controller.plan, config, None, backend=run.backend,
                                            formats=run.snip.formats, user_recipe=run.user_recipe,
                                            sm=None if run.te is None else run.te.sm,
                                            inventory=run.loop.inventory, offset=offset)
        return spec


def check_emulated_spec(spec, backend: str) -> None:
    """The emulated backend replaces the planned linears of a local spec; a Transformer Engine
    spec fuses the attention norm into the layer's first linear (TELayerNormColumnParallelLinear),
    so replacing it would drop that norm: refused."""
    from snip_megatron.models import gpt_spec

    if not hasattr(getattr(spec, "submodules", None), "self_attention"):
        return
    first = gpt_spec.spec_linear_class(spec, gpt_spec.first_linear_suffix())
    if backend == "emulated" and "transformer_engine" in getattr(first, "__module__", ""):
        raise ValueError(f"model.transformer_impl='local' (SNIP's emulated linears) with a Transformer "
                         f"Engine layer spec ({first.__name__}): set model.transformer_layer_spec="
                         "local_layer_spec, or model.transformer_impl='transformer_engine' for TE linears")


def spec_for_backend(user_spec, backend: str, multi_latent_attention: bool = False):
    """The spec SNIP builds on. Bridge's default spec is Transformer Engine's whatever
    `transformer_impl` says; the emulated backend (transformer_impl='local') takes Bridge's local
    spec instead. Bridge's own layer specs build dense attention whatever `multi_latent_attention`
    says (its MLA models take a decoder block spec, which SNIP cannot plan): with MLA they are
    Megatron's MLA layer spec (`mla_layer_spec`). Any other spec is the user's, kept (its planned
    linears are replaced or planned)."""
    from megatron.bridge.models import gpt_provider

    bridges = (gpt_provider.default_layer_spec, gpt_provider.local_layer_spec,
               gpt_provider.transformer_engine_layer_spec)
    if multi_latent_attention and any(user_spec is s for s in bridges):
        return mla_layer_spec
    if backend == "emulated" and user_spec is gpt_provider.default_layer_spec:
        return gpt_provider.local_layer_spec
    return user_spec


def mla_layer_spec(config):
    """Megatron's multi-latent-attention GPT layer spec for a Bridge model config, as Megatron-LM's
    default spec builds it: Transformer Engine's (transformer_impl='transformer_engine'), else the
    local one with SNIP's MLA core and TP-duplicated down-projections (snip_megatron/megatron/mla.py).
    An MoE model's layers (DeepSeek's) get its experts, as Bridge's own layer specs give them."""
    from snip_megatron.megatron.spec import get_local_layer_spec

    common = dict(multi_latent_attention=True, qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
                  num_experts=getattr(config, "num_moe_experts", None),
                  moe_grouped_gemm=bool(getattr(config, "moe_grouped_gemm", False)))
    if getattr(config, "transformer_impl", None) == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(**common)
    return get_local_layer_spec(config.normalization, **common)


def snip_mtp_block_spec(run, config, vp_stage=None):
    """The multi-token-prediction block of a Bridge model on SNIP's emulated backend. Bridge builds
    it from the layer spec (SnipLayerSpec, so the inner layer has SNIP's linears) but always with
    Transformer Engine's norms and eh_proj (gpt_provider.mtp_block_spec); here they are Megatron's
    local ones, as Megatron-LM builds them for transformer_impl='local', with SNIP's emulated
    eh_proj (pretrain.model.with_planned_mtp_linears). The TE backend keeps Bridge's block."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from snip_megatron.pretrain.model import with_planned_mtp_linears

    if not getattr(config, "mtp_num_layers", None):
        return None
    spec = config.transformer_layer_spec(config, vp_stage=vp_stage)
    block = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
    return with_planned_mtp_linears(block, run.backend)
