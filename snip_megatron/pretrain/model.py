"""The model SNIP trains in Megatron-LM: Megatron's own layer spec (every model flag keeps its
effect), SNIP's emulated linears put in for the emulated backend, and each chunk's quant_recipe.

`GPTModelBuilder.build_model` resolves `model_cfg.transformer_layer_spec` right before it builds
each model chunk, passing that chunk's `vp_stage`, and GPTModel's `finish_init` loop then reads
`TransformerConfig.quant_recipe`. So the spec function below sets the recipe of the chunk about to
be built: the plan keyed by global layer needs each chunk's own layer offset (Megatron's, uneven
splits included), while the config object is shared by all chunks.
"""

from __future__ import annotations

import inspect

from snip_megatron.megatron.quant_recipe import PlanMatcher, config_dict_for


def resolve_spec(user_spec, model_config, vp_stage):
    """The layer spec Megatron would build: the user's `--spec` (a spec or a spec function), else
    Megatron-LM's `default_layer_spec` (TE or local, qk-layernorm, ...)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if user_spec is None:
        from megatron.training.models.gpt import default_layer_spec

        return default_layer_spec(model_config, vp_stage)
    if isinstance(user_spec, ModuleSpec) or not callable(user_spec):
        return user_spec
    if "vp_stage" in inspect.signature(user_spec).parameters:
        return user_spec(model_config, vp_stage=vp_stage)
    return user_spec(model_config)


def with_planned_linears(spec, backend: str):
    """The spec with SNIP's emulated linears for the emulated backend; the TE backend keeps
    Megatron's TE linears (they read the plan through quant_recipe). A spec whose planned linears
    SNIP cannot find (a block spec, another attention) is refused."""
    from snip_megatron.models import gpt_spec

    lacking = gpt_spec.spec_lacks(spec)
    if lacking:
        raise ValueError(f"the layer spec ({type(spec).__name__}) has no {' / '.join(lacking)}: SNIP plans "
                         "the GPT layer's attention and dense MLP linears only")
    if backend != "emulated":
        return spec
    from snip_megatron.megatron.spec import with_emulated_linears

    return with_emulated_linears(spec)


def with_planned_mtp_linears(block_spec, backend: str):
    """Megatron-LM builds the multi-token-prediction block from its own decoder layer spec, not from
    `transformer_layer_spec` (megatron/training/models/gpt.py `mtp_block_spec`): SNIP's emulated
    linears go into its eh_proj and inner layer as into the decoder's."""
    if block_spec is None or backend != "emulated":
        return block_spec
    from snip_megatron.emulation.parallel_linear import QuantColumnParallelLinear
    from snip_megatron.models import gpt, gpt_spec

    return gpt_spec.replace_mtp_planned_linears(block_spec, QuantColumnParallelLinear,
                                           lambda spec: with_planned_linears(spec, backend))


def merged_recipe(plan, transformer_config, vp_stage, *, backend: str, formats, user_recipe=None,
                  sm: "int | None" = None, inventory=None, offset: "int | None" = None):
    """This chunk's RecipeConfig: SNIP's plan first, then the user's own matchers (modules SNIP
    does not plan keep what the user's precision config gives them). `sm`: the GPU of the TE dicts.
    `inventory`: the model's planned linears (default a dense GPT of the config's layers), whose
    family names the chunk's module paths; `offset`: the chunk's global layers before it (default
    Megatron's GPT offset)."""
    from megatron.core.quantization.quant_config import RecipeConfig

    from snip_megatron.megatron.quant_recipe import check_runnable, layer_offset
    from snip_megatron.models import gpt

    plan.check_model(gpt.of_config(transformer_config) if inventory is None else inventory)
    kind = "te" if backend == "te" else "emulated"
    ours = config_dict_for(kind, formats=formats, sm=sm)
    check_runnable(plan, ours, backend=kind, sm=sm, formats=formats)
    if offset is None:
        offset = layer_offset(transformer_config, vp_stage=vp_stage)
    matchers = [PlanMatcher(plan, layer_offset=offset, family=gpt.FAMILY if inventory is None else inventory.family)]
    configs = dict(ours)
    if user_recipe is not None:
        matchers += list(user_recipe.matchers)
        configs.update(user_recipe.configs)
    return RecipeConfig(matchers=matchers, config_dict=configs)


def check_user_recipe(user_recipe, model, source: str) -> None:
    """A user's precision config (`--te-precision-config-file`) may set modules SNIP does not
    plan; one that sets a planned linear, or reuses SNIP's config names, is refused. `model`: an
    Inventory, or a dense GPT's layer count."""
    from snip_megatron.formats.precision import Precision
    from snip_megatron.megatron.apply import match_context
    from snip_megatron.models import gpt
    from snip_megatron.models.registry import adapter
    from snip_megatron.plan import model_keys

    if user_recipe is None:
        return
    clash = sorted(set(user_recipe.configs) & {p.value for p in Precision})
    if clash:
        raise ValueError(f"{source} defines config keys {clash}, the names SNIP's plan uses; rename them")
    # each planned linear's path as if the model were one stage
    paths = ([(k, path) for k in model_keys(model) for path in gpt.module_paths(k)] if isinstance(model, int)
             else [(e.key, path) for e in model for path in adapter(model.family).module_paths(e)])
    for planned, path in paths:
        for matcher in user_recipe.matchers:
            key = matcher.match(match_context(path))
            if key is not None:
                raise ValueError(f"{source} sets {path} (config {key!r}), a linear SNIP plans; "
                                 "drop that matcher, or freeze a plan with --snip-plan PATH "
                                 "--snip-pin-plan instead")


def snip_layer_spec(run, user_spec):
    """The `transformer_layer_spec` function for Megatron's GPTModelBuilder (see module docstring)."""

    def layer_spec(model_config, vp_stage=None):
        spec = with_planned_linears(resolve_spec(user_spec, model_config, vp_stage), run.backend)
        model_config.transformer.quant_recipe = merged_recipe(
            run.controller.plan, model_config.transformer, vp_stage, backend=run.backend,
            formats=run.config.formats, user_recipe=run.user_recipe, sm=run.sm)
        return spec

    return layer_spec


def snip_hybrid_builder(run, pattern: str):
    """The model builder of a HybridModel run (Megatron's HybridModelBuilder): before it builds a
    chunk, the transformer config's quant_recipe is set to that chunk's plan, with the layer
    offset Megatron's `select_pipeline_segment` gives this pipeline rank (HybridModel resolves each
    TE linear's recipe as it builds it, and again in its post-init loop)."""
    from megatron.training.models.hybrid import HybridModelBuilder

    from snip_megatron.models import hybrid

    class SnipHybridModelBuilder(HybridModelBuilder):
        def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
            offset = hybrid.chunk_offset(pattern, pg_collection.pp, vp_stage)
            transformer = self._model_config.transformer
            transformer.quant_recipe = merged_recipe(
                run.controller.plan, transformer, vp_stage, backend=run.backend, formats=run.config.formats,
                user_recipe=run.user_recipe, sm=run.sm, inventory=run.inventory, offset=offset)
            return super().build_model(pg_collection, pre_process, post_process, vp_stage)

    return SnipHybridModelBuilder
