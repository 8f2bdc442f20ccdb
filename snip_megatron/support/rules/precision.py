"""Rules on precision settings that fight a per-layer plan, and on the backend that runs it.

A per-layer plan needs every planned linear free to run BF16, FP8 or FP4 and to switch between
them at a step boundary: one global FP8/FP4 autocast, weights stored in FP8/FP4, layers kept in
BF16 by rule or another quantizer than SNIP's fight that.
"""

from __future__ import annotations

from snip_megatron.support.rule import Rule

FORMATS_FIX = ("{n[snip.initial_precision]} and {n[snip.precisions]} choose the formats per layer")


def _stored(s, *paths):
    """{"lead": the first of `paths` that is set}, else None."""
    lead = next((p for p in paths if s.get(p)), None)
    return {"lead": lead} if lead else None


RULES = (
    Rule("global-fp8", ("model.fp8",), lambda s: s.get("model.fp8"),
         "{nv[model.fp8]}: one global FP8 autocast fights SNIP's per-layer plan",
         "{drop[model.fp8]} (" + FORMATS_FIX + ")", example={"model.fp8": "e4m3"}),
    Rule("fp8-delayed-scaling", ("model.fp8_recipe", "model.fp8"),
         lambda s: s.get("model.fp8") and s.get("model.fp8_recipe") == "delayed",
         "{nv[model.fp8_recipe]} (delayed scaling) keeps an amax history per module across steps, which "
         "cannot switch per layer", "{drop[model.fp8]} ({n[snip.fp8_recipe]} picks blockwise, tensorwise or mxfp8)",
         example={"model.fp8": "e4m3", "model.fp8_recipe": "delayed"}),
    Rule("fp8-custom-recipe", ("model.fp8_recipe", "model.fp8"),
         lambda s: s.get("model.fp8") and s.get("model.fp8_recipe") == "custom",
         "{nv[model.fp8_recipe]} (a quantizer factory) quantizes every layer its own way",
         "{drop[model.fp8]}: SNIP runs its own recipes per layer",
         example={"model.fp8": "e4m3", "model.fp8_recipe": "custom",
                  "model.fp8_quantizer_factory": "my_package.quantizer_factory"}),
    Rule("global-fp4", ("model.fp4",), lambda s: s.get("model.fp4"),
         "{nv[model.fp4]}: one global FP4 autocast fights SNIP's per-layer plan",
         "{drop[model.fp4]} (" + FORMATS_FIX + ")", example={"model.fp4": "e2m1"}),
    Rule("fp8-params", ("model.fp8_param", "ddp.fp8_param_gather"),
         lambda s: _stored(s, "model.fp8_param", "ddp.fp8_param_gather"),
         "{nx[lead]}: weights stored or gathered in FP8, so a layer cannot change precision", "{drop[model.fp8_param]}",
         example={"model.fp8_param": True, "model.fp8": "e4m3", "ddp.use_distributed_optimizer": True}),
    Rule("fp4-params", ("model.fp4_param", "ddp.fp4_param_gather"),
         lambda s: _stored(s, "model.fp4_param", "ddp.fp4_param_gather"),
         "{nx[lead]}: weights stored or gathered in FP4, so a layer cannot change precision", "{drop[model.fp4_param]}",
         example={"model.fp4_param": True, "model.fp4": "e2m1", "ddp.use_distributed_optimizer": True}),
    Rule("mxfp8-param-buffers", ("ddp.reuse_grad_buf_for_mxfp8_param_ag", "optimizer.reuse_grad_buf_for_mxfp8_param_ag"),
         lambda s: _stored(s, "ddp.reuse_grad_buf_for_mxfp8_param_ag", "optimizer.reuse_grad_buf_for_mxfp8_param_ag"),
         "{nx[lead]} goes with MXFP8 parameter storage, so a layer cannot change precision",
         "{drop[ddp.reuse_grad_buf_for_mxfp8_param_ag]}", example={"ddp.reuse_grad_buf_for_mxfp8_param_ag": True, "model.fp8_param": True, "model.fp8": "e4m3",
                  "model.fp8_recipe": "mxfp8", "ddp.use_distributed_optimizer": True}),
    Rule("bf16-layers-by-rule", ("model.first_last_layers_bf16",), lambda s: s.get("model.first_last_layers_bf16"),
         "{n[model.first_last_layers_bf16]} keeps the first {v[model.num_layers_at_start_in_bf16]} and last "
         "{v[model.num_layers_at_end_in_bf16]} layers in BF16 by rule (the planner decides instead; "
         "{n[snip.baseline]} first_last_k is that rule)", "{drop[model.first_last_layers_bf16]}",
         example={"model.first_last_layers_bf16": True}),
    Rule("fp8-attention", ("model.fp8_dot_product_attention", "model.fp8_multi_head_attention"),
         lambda s: _stored(s, "model.fp8_dot_product_attention", "model.fp8_multi_head_attention"),
         "{nx[lead]} runs attention under a global FP8 autocast", "{drop[model.fp8_dot_product_attention]}",
         example={"model.fp8_dot_product_attention": True}),
    Rule("kitchen", ("model.use_kitchen",), lambda s: s.get("model.use_kitchen"),
         "{n[model.use_kitchen]} quantizes through NVIDIA Kitchen instead of SNIP's plan",
         "{drop[model.use_kitchen]}", example={"model.use_kitchen": True}),
    Rule("transformer-impl", ("model.transformer_impl",),
         lambda s: s.get("model.transformer_impl") not in ("local", "transformer_engine"),
         "{nv[model.transformer_impl]}: SNIP plans Megatron's local linears (SNIP's "
         "emulated ones) or its Transformer Engine linears",
         "use {set[model.transformer_impl]:local} or {set[model.transformer_impl]:transformer_engine}",
         example={"model.transformer_impl": "inference_optimized"},
         entries=("megatron-lm", "bridge")),  # the compact loop's --backend builds local or TE linears only
    Rule("emulated-needs-local-spec", ("run.backend", "model.transformer_impl"),
         lambda s: s.run.backend == "emulated" and s.get("model.transformer_impl") == "transformer_engine",
         "--snip-backend emulated needs Megatron's local layer spec",
         "add {set[model.transformer_impl]:local} (or use --snip-backend te for Transformer Engine's linears)",
         example={"run.backend": "emulated", "model.transformer_impl": "transformer_engine"},
         entries=("megatron-lm",)),
    Rule("te-needs-te-spec", ("run.backend", "model.transformer_impl"),
         lambda s: s.run.backend == "te" and s.get("model.transformer_impl") != "transformer_engine",
         "--snip-backend te needs {set[model.transformer_impl]:transformer_engine}",
         "add it, or drop --snip-backend te", example={"run.backend": "te", "model.transformer_impl": "local"},
         entries=("megatron-lm",)),
    Rule("compact-te", ("model.transformer_impl",), lambda s: s.run.backend == "te",
         "{set[model.transformer_impl]:transformer_engine}: the compact loop's Transformer Engine path needs a GPU and "
         "no test runs it", "train TE linears with snip-pretrain-gpt --transformer-impl transformer_engine (or "
         "use {set[model.transformer_impl]:local})",
         example={"run.backend": "te", "model.transformer_impl": "transformer_engine", "run.te_installed": True},
         entries=("compact",)),
    Rule("te-not-installed", ("model.transformer_impl",),
         lambda s: s.run.backend == "te" and not s.run.te_installed,
         "{set[model.transformer_impl]:transformer_engine}: Transformer Engine is not installed here",
         "use {set[model.transformer_impl]:local} (SNIP's emulated linears), or install Transformer Engine on "
         "a GPU machine", example={"run.backend": "te", "model.transformer_impl": "transformer_engine",
                                    "run.te_installed": False}),
)
