"""Rules on the model a run builds: the families SNIP plans (GPT with MLA and MTP, HybridModel),
their variants it does not plan yet, and what each needs to train as one process does."""

from __future__ import annotations

from snip_megatron.models import hybrid
from snip_megatron.support.rule import Rule
from snip_megatron.support.settings import ENTRIES


def _mla(s) -> bool:
    return bool(s.get("model.multi_latent_attention"))


def _pattern_error(s):
    """{"why": the pattern's problem} when a HybridModel's pattern has layers SNIP cannot plan."""
    pattern = s.run.hybrid_pattern
    if s.run.family != hybrid.FAMILY or not pattern:
        return None
    try:
        hybrid.layer_symbols(pattern)
    except ValueError as e:
        return {"why": str(e).split(": ", 1)[-1]}
    return None


def _cuda_layers(s):
    """{"kinds": ...} when the pattern has Mamba or GDN layers and no GPU runs their kernels."""
    pattern = s.run.hybrid_pattern
    if s.run.family != hybrid.FAMILY or not pattern or s.run.cuda or _pattern_error(s):
        return None
    kinds = [f"{hybrid.LAYER_NAMES[c]} ({c})" for c in dict.fromkeys(hybrid.layer_symbols(pattern)) if c in "MG"]
    return {"kinds": " and ".join(kinds)} if kinds else None


def _hybrid_moe(s) -> bool:
    return s.run.family == hybrid.FAMILY and hybrid.MOE in (s.run.hybrid_pattern or "")


def _stage_without_experts(s):
    """{"stage": a pipeline rank} when a hybrid MoE model's pipeline leaves a stage (its virtual chunks
    together) without an MoE layer."""
    pattern, pp = s.run.hybrid_pattern, s.num("model.pipeline_model_parallel_size")
    if not _hybrid_moe(s) or pp <= 1 or _pattern_error(s):
        return None
    segments = len(hybrid.parse_pattern(pattern))
    chunks = [None] if segments == 1 else list(range(segments // pp))
    try:
        for rank in range(pp):
            if not any(hybrid.MOE in hybrid.segment(pattern, rank, pp, v)[1] for v in chunks):
                return {"stage": rank}
    except ValueError:  # a pattern Megatron's own allocation refuses, by its message
        return None
    return None


RULES = (
    Rule("other-model-family", ("run.family",), lambda s: s.run.family not in ("gpt", hybrid.FAMILY),
         "model is a {v[run.family]}: SNIP plans GPT models built by GPTModelProvider (the gpt, llama, qwen ... "
         "recipes; MLAModelProvider's multi-latent attention) and HybridModels built by HybridModelProvider",
         "use one of those providers, or run without SNIP", example={"run.family": "T5ModelProvider"},
         entries=("bridge",)),
    Rule("mla-down-proj-fusion", ("model.mla_down_proj_fusion",),
         lambda s: _mla(s) and s.get("model.mla_down_proj_fusion"),
         "{n[model.mla_down_proj_fusion]}: SNIP plans multi-latent attention's separate q/kv down-projections",
         "{drop[model.mla_down_proj_fusion]}", example={"model.multi_latent_attention": True,
                                                       "model.mla_down_proj_fusion": True}),
    Rule("mla-needs-mla-config", ("model.multi_latent_attention",),
         lambda s: _mla(s) and not hasattr(s.model, "kv_lora_rank"),
         "{n[model.multi_latent_attention]} on a config without MLA widths (kv_lora_rank, qk_head_dim, ...)",
         "use megatron.bridge.models.mla_provider.MLAModelProvider (or a provider derived from it)",
         example={"model.multi_latent_attention": True}, entries=("bridge",)),
    Rule("mla-tp-needs-sp", ("model.multi_latent_attention", "model.sequence_parallel"),
         lambda s: _mla(s) and s.num("model.tensor_model_parallel_size") > 1 and not s.get("model.sequence_parallel"),
         "{n[model.multi_latent_attention]} at {n[model.tensor_model_parallel_size]} > 1 needs "
         "{set[model.sequence_parallel]:True}: without it Megatron's MLA takes the shared rotary key's gradient from "
         "each rank's own heads, so TP ranks train another model than one process (snip_megatron/megatron/mla.py)",
         "add it", example={"model.multi_latent_attention": True, "model.tensor_model_parallel_size": 2, "run.world_size": 2},
         entries=("megatron-lm", "bridge")),
    Rule("compact-mla-tp", ("model.multi_latent_attention", "model.tensor_model_parallel_size"),
         lambda s: _mla(s) and s.num("model.tensor_model_parallel_size") > 1,
         "{n[model.multi_latent_attention]} at {nv[model.tensor_model_parallel_size]}: "
         "Megatron's MLA needs sequence parallelism at TP > 1, which the compact loop does not run",
         "use --tp 1, or snip-pretrain-gpt --multi-latent-attention --sequence-parallel",
         example={"model.multi_latent_attention": True, "model.tensor_model_parallel_size": 2},
         entries=("compact",)),
    Rule("mtp-pp-tied-embeddings", ("model.share_embeddings_and_output_weights", "model.mtp_num_layers"),
         lambda s: (s.get("model.mtp_num_layers") and s.num("model.pipeline_model_parallel_size") > 1
                    and s.get("model.share_embeddings_and_output_weights")),
         "{n[model.mtp_num_layers]} with {n[model.pipeline_model_parallel_size]} > 1 and "
         "{n[model.share_embeddings_and_output_weights]}: the last stage's output layer keeps a weight of its "
         "own (GPTModel skips it on the first stage only), which Megatron's checkpointing asserts it does not "
         "have beside MTP (tie_embeddings_and_output_weights_state_dict, "
         "megatron/core/models/common/language_module/language_module.py): the run fails at its first save or load",
         "set {n[model.share_embeddings_and_output_weights]}=False (DeepSeek-V3 unties them)",
         example={"model.mtp_num_layers": 1, "model.pipeline_model_parallel_size": 2,
                  "model.share_embeddings_and_output_weights": True}, entries=("bridge",)),
    Rule("gpt-entry-hybrid-pattern", ("run.hybrid_pattern",),
         lambda s: s.run.family == "gpt" and s.run.hybrid_pattern,
         "{n[run.hybrid_pattern]} builds a HybridModel, which pretrain_gpt.py does not",
         "run snip-pretrain-hybrid (Megatron-LM's pretrain_hybrid.py with SNIP) instead",
         example={"run.family": "gpt", "run.hybrid_pattern": "*-"}, entries=("megatron-lm",)),
    Rule("hybrid-needs-pattern", ("run.hybrid_pattern",),
         lambda s: s.run.family == hybrid.FAMILY and not s.run.hybrid_pattern,
         "snip-pretrain-hybrid needs {n[run.hybrid_pattern]}", "give it (e.g. '*-*-': attention, MLP, ...)",
         example={"run.family": hybrid.FAMILY, "run.hybrid_pattern": None}, entries=("megatron-lm",)),
    Rule("hybrid-layer-kinds", ("run.hybrid_pattern",), _pattern_error,
         "{n[run.hybrid_pattern]} {v[run.hybrid_pattern]!r}: {x[why]}", "change the pattern",
         example={"run.family": hybrid.FAMILY, "run.hybrid_pattern": "+-", "model.multi_latent_attention": True,
                  "model.transformer_impl": "transformer_engine", "run.backend": "te", "run.te_installed": True}),
    Rule("hybrid-needs-te", ("model.transformer_impl",),
         lambda s: s.run.family == hybrid.FAMILY and s.run.backend != "te",
         "SNIP plans a HybridModel's Transformer Engine linears (Megatron's hybrid layer spec is TE-only; SNIP's "
         "emulated linears build no HybridModel)", "use {set[model.transformer_impl]:transformer_engine}",
         example={"run.family": hybrid.FAMILY, "run.hybrid_pattern": "*-", "run.backend": "emulated",
                  "model.transformer_impl": "local"}, entries=(*ENTRIES, "export")),
    Rule("hybrid-cuda-layers", ("run.hybrid_pattern",), _cuda_layers,
         "{n[run.hybrid_pattern]} {v[run.hybrid_pattern]!r}: {x[kinds]} layers run CUDA kernels (mamba_ssm, "
         "causal_conv1d; fla), so on CPU SNIP cannot measure their in_proj/out_proj linears",
         "run on a GPU (bench/gpu/hybrid_check.py), or use '*' and '-' layers only",
         example={"run.family": hybrid.FAMILY, "run.hybrid_pattern": "M*", "run.cuda": False}),
    Rule("hybrid-moe-needs-experts", ("run.hybrid_pattern", "model.num_moe_experts"),
         lambda s: _hybrid_moe(s) and not s.get("model.num_moe_experts"),
         "{n[run.hybrid_pattern]} {v[run.hybrid_pattern]!r} has MoE (E) layers",
         "add {n[model.num_moe_experts]} (and {n[model.moe_grouped_gemm]}: SNIP plans a hybrid MoE layer's experts "
         "as TE grouped linears)", example={"run.family": hybrid.FAMILY, "run.hybrid_pattern": "*E",
                                           "model.num_moe_experts": None}),
    Rule("hybrid-moe-layer-freq", ("model.moe_layer_freq",),
         lambda s: s.run.family == hybrid.FAMILY and s.get("model.num_moe_experts")
         and s.get("model.moe_layer_freq", 1) != 1,
         "{n[model.moe_layer_freq]} has no effect on a HybridModel (its pattern's E symbols are the MoE layers)",
         "{drop[model.moe_layer_freq]}", example={"run.family": hybrid.FAMILY, "run.hybrid_pattern": "*E",
                                                 "model.num_moe_experts": 4, "model.moe_layer_freq": 2}),
    Rule("hybrid-mtp", ("model.mtp_hybrid_override_pattern",),
         lambda s: s.run.family == hybrid.FAMILY and s.get("model.mtp_hybrid_override_pattern"),
         "{n[model.mtp_hybrid_override_pattern]} (multi-token prediction of a HybridModel): SNIP does not plan MTP "
         "layers of a HybridModel yet", "{drop[model.mtp_hybrid_override_pattern]}",
         example={"run.family": hybrid.FAMILY, "run.hybrid_pattern": "*-",
                  "model.mtp_hybrid_override_pattern": "*-"}, entries=("bridge",)),
    Rule("hybrid-vpp-bridge", ("model.virtual_pipeline_model_parallel_size",),
         lambda s: s.run.family == hybrid.FAMILY and s.num("model.virtual_pipeline_model_parallel_size") > 1,
         "{nv[model.virtual_pipeline_model_parallel_size]} with a HybridModel: Bridge's HybridModelProvider builds "
         "no HybridModel under virtual pipelining (its provide() asserts virtual_pipeline_model_parallel_size is None)",
         "{drop[model.virtual_pipeline_model_parallel_size]}, or run snip-pretrain-hybrid (Megatron-LM's "
         "pretrain_hybrid.py with SNIP plans a HybridModel's virtual stages)",
         example={"run.family": hybrid.FAMILY, "run.hybrid_pattern": "*-*-", "model.pipeline_model_parallel_size": 2,
                  "model.virtual_pipeline_model_parallel_size": 2, "run.world_size": 2}, entries=("bridge",)),
    Rule("hybrid-moe-stage-without-experts", ("run.hybrid_pattern", "model.pipeline_model_parallel_size"),
         _stage_without_experts,
         "{n[run.hybrid_pattern]} {v[run.hybrid_pattern]!r} at {nv[model.pipeline_model_parallel_size]}: pipeline "
         "stage {x[stage]} holds no MoE (E) layer, and Megatron-LM's MoE logging then all-reduces metrics of other "
         "sizes across the stages and hangs (megatron/training/training.py training_log: force_initialize sizes "
         "them by the pattern's MoE layer count, the routers by all its layers)",
         "cut the pattern with '|' so that every stage, its virtual chunks together, holds an E layer",
         example={"run.family": hybrid.FAMILY, "run.hybrid_pattern": "*|E|*|E", "model.num_moe_experts": 4,
                  "model.pipeline_model_parallel_size": 2, "run.world_size": 2}, entries=("megatron-lm",)),
    Rule("mtp-hsm", ("model.mtp_hsm",), lambda s: s.get("model.mtp_hsm"),
         "{n[model.mtp_hsm]} (Megatron main): MTP layers mix their inputs per token with random draws, and SNIP's "
         "lone-micro-batch noise pass would draw on other shapes than its clean pass (two networks compared)",
         "{drop[model.mtp_hsm]}", example={"model.mtp_num_layers": 2, "model.mtp_hsm": True},
         entries=("megatron-lm", "bridge")),
)
