"""Rules on mixture-of-experts runs. SNIP plans, measures and re-plans MoE models on Megatron's local
spec (SequentialMLP experts with SNIP's emulated linears) and on the TE spec with grouped experts
(TEGroupedMLP), with either the allgather or the alltoall dispatcher, at the layouts docs/support.md
lists (expert, tensor, expert-tensor, pipeline with virtual stages, data and context parallelism,
recompute; docs/moe.md); these rules refuse the rest, each with its reason."""

from __future__ import annotations

from snip_megatron.support.rule import Rule

MOE = {"model.num_moe_experts": 4, "model.moe_router_topk": 2}
"""The smallest MoE settings an example adds to a dense model."""


def moe(s) -> bool:
    return bool(s.get("model.num_moe_experts"))


def _te(s) -> bool:
    return s.get("model.transformer_impl") == "transformer_engine"


def _etp(s) -> int:
    etp = s.get("model.expert_tensor_parallel_size")
    return int(etp) if etp is not None else s.num("model.tensor_model_parallel_size")


def _balancing(s):
    kinds = s.get("model.moe_router_load_balancing_type", "aux_loss")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    odd = [k for k in kinds if k in ("sinkhorn", "quantile_balancing")]
    return {"kinds": " ".join(odd)} if odd else None


def _cp_wide_experts(s):
    """Experts under CP fed other ranks' tokens: the first of TP, EP and expert TP above 1."""
    if not moe(s) or s.num("model.context_parallel_size") <= 1:
        return None
    sizes = {"model.tensor_model_parallel_size": s.num("model.tensor_model_parallel_size"),
             "model.expert_model_parallel_size": s.num("model.expert_model_parallel_size"),
             "model.expert_tensor_parallel_size": _etp(s)}
    return next(({"lead": path} for path, size in sizes.items() if size > 1), None)


RULES = (
    Rule("moe-grouped-needs-te", ("model.moe_grouped_gemm", "model.transformer_impl"),
         lambda s: moe(s) and s.get("model.moe_grouped_gemm") and not _te(s),
         "{n[model.moe_grouped_gemm]} with {n[model.transformer_impl]} local: SNIP runs grouped experts on "
         "Transformer Engine's GroupedLinear only",
         "add {set[model.transformer_impl]:transformer_engine}, or {drop[model.moe_grouped_gemm]} (SequentialMLP "
         "experts)", example={**MOE, "model.moe_grouped_gemm": True, "model.transformer_impl": "local"}),
    Rule("moe-te-needs-grouped", ("model.num_moe_experts", "model.moe_grouped_gemm"),
         lambda s: moe(s) and _te(s) and not s.get("model.moe_grouped_gemm"),
         "{n[model.num_moe_experts]} with {n[model.transformer_impl]} transformer_engine without "
         "{n[model.moe_grouped_gemm]}: SNIP pads expert token splits for per-module FP8/FP4 on TE's grouped GEMM only",
         "add {set[model.moe_grouped_gemm]:True}",
         example={**MOE, "model.transformer_impl": "transformer_engine", "run.backend": "te",
                  "model.moe_grouped_gemm": False}, entries=("megatron-lm", "bridge")),
    Rule("moe-local-tp", ("model.tensor_model_parallel_size", "model.num_moe_experts"),
         lambda s: moe(s) and not _te(s) and s.num("model.tensor_model_parallel_size") > 1,
         "{n[model.tensor_model_parallel_size]} > 1 with {n[model.num_moe_experts]} on {n[model.transformer_impl]} "
         "local: Megatron's MoE layer trains at TP > 1 only with sequence parallelism, and the local spec builds "
         "RMSNorm (and LayerNorm without apex) as a torch norm, which refuses it",
         "run MoE at {set[model.tensor_model_parallel_size]:1} (expert and data parallelism), or on "
         "{set[model.transformer_impl]:transformer_engine} {set[model.moe_grouped_gemm]:True}",
         example={**MOE, "model.tensor_model_parallel_size": 2, "model.sequence_parallel": True, "run.world_size": 2},
         entries=("megatron-lm", "bridge")),
    Rule("moe-expert-tp", ("model.expert_tensor_parallel_size", "model.num_moe_experts"),
         lambda s: moe(s) and 1 < s.num("model.tensor_model_parallel_size") < _etp(s),
         "{nv[model.expert_tensor_parallel_size]} over {nv[model.tensor_model_parallel_size]}: SNIP measures and "
         "re-plans experts at expert TP 2 over TP 1 and at expert TP = TP; expert TP wider than a TP > 1 is untested",
         "use {set[model.expert_tensor_parallel_size]:2} at {set[model.tensor_model_parallel_size]:1}, or expert TP "
         "<= TP", example={**MOE, "model.transformer_impl": "transformer_engine", "run.backend": "te",
                           "model.moe_grouped_gemm": True, "model.tensor_model_parallel_size": 2,
                           "model.sequence_parallel": True, "model.expert_tensor_parallel_size": 4,
                           "run.world_size": 4}, entries=("megatron-lm", "bridge")),
    Rule("moe-cp", ("model.context_parallel_size", "model.tensor_model_parallel_size",
                    "model.expert_model_parallel_size", "model.expert_tensor_parallel_size", "model.num_moe_experts"),
         _cp_wide_experts,
         "{nv[model.context_parallel_size]} with {n[model.num_moe_experts]} and {nx[lead]} > 1: under context "
         "parallelism SNIP gathers each expert's rows over CP and puts them in the micro-batch's order from each CP "
         "rank's own routing, which holds where Megatron's token dispatcher moves no token between ranks (TP, EP and "
         "expert TP 1); experts fed other ranks' tokens under CP are untested",
         "run the experts at {set[model.tensor_model_parallel_size]:1} {set[model.expert_model_parallel_size]:1} "
         "{set[model.expert_tensor_parallel_size]:1} under CP, or {set[model.context_parallel_size]:1}",
         example={**MOE, "model.transformer_impl": "transformer_engine", "run.backend": "te",
                  "model.moe_grouped_gemm": True, "model.context_parallel_size": 2,
                  "model.expert_model_parallel_size": 2, "run.world_size": 2}, entries=("megatron-lm", "bridge")),
    Rule("moe-flex-dispatcher", ("model.moe_token_dispatcher_type",),
         lambda s: moe(s) and s.get("model.moe_token_dispatcher_type") == "flex",
         "{nv[model.moe_token_dispatcher_type]}: Megatron's flex dispatcher moves tokens through DeepEP's or "
         "HybridEP's CUDA kernels (deep_ep.Buffer, HybridEPBuffer: transformer/moe/fused_a2a.py) or Transformer "
         "Engine's NCCL EP, which no CPU runs; SNIP has not measured experts behind any of them",
         "use {set[model.moe_token_dispatcher_type]:alltoall} (or allgather)",
         example={**MOE, "model.expert_model_parallel_size": 2, "model.moe_token_dispatcher_type": "flex",
                  "run.world_size": 2}, entries=("megatron-lm", "bridge")),
    Rule("moe-router-fusion", ("model.moe_router_fusion",), lambda s: moe(s) and s.get("model.moe_router_fusion"),
         "{n[model.moe_router_fusion]}: the fused top-k bypasses Megatron's router-replay hook, which SNIP uses to "
         "keep routing fixed across its measurement passes", "{drop[model.moe_router_fusion]}",
         example={**MOE, "model.moe_router_fusion": True}),
    Rule("moe-balancing", ("model.moe_router_load_balancing_type",), lambda s: moe(s) and _balancing(s),
         "{n[model.moe_router_load_balancing_type]} {x[kinds]}: routes without Megatron's top-k replay hook, so "
         "SNIP cannot freeze routing while it measures", "use aux_loss, seq_aux_loss, global_aux_loss or none",
         example={**MOE, "model.moe_router_load_balancing_type": "sinkhorn"}),
    Rule("moe-capacity", ("model.moe_expert_capacity_factor",),
         lambda s: moe(s) and s.get("model.moe_expert_capacity_factor") is not None,
         "{n[model.moe_expert_capacity_factor]}: token dropping follows the routing probabilities, which SNIP's "
         "noise passes change", "{drop[model.moe_expert_capacity_factor]} (dropless MoE)",
         example={**MOE, "model.moe_expert_capacity_factor": 1.0}),
    Rule("moe-latent-local", ("model.moe_latent_size",),
         lambda s: moe(s) and s.get("model.moe_latent_size") and not _te(s),
         "{n[model.moe_latent_size]} on {n[model.transformer_impl]} local: Megatron builds the latent projections "
         "as Transformer Engine linears only ('TransformerEngine is required for MoE latent projections', "
         "megatron/core/transformer/moe/moe_layer.py)", "use {set[model.transformer_impl]:transformer_engine} "
         "{set[model.moe_grouped_gemm]:True}, or {drop[model.moe_latent_size]}",
         example={**MOE, "model.moe_latent_size": 32}, entries=("megatron-lm", "bridge")),
    Rule("moe-compact-processes", ("run.world_size", "model.num_moe_experts"),
         lambda s: moe(s) and s.run.world_size > 1,
         "MoE on {v[run.world_size]} processes: the compact loop runs MoE at one process",
         "snip-pretrain-gpt runs it at expert, pipeline and data parallelism (docs/moe.md)",
         example={**MOE, "run.world_size": 2}, entries=("compact",)),
    Rule("moe-grouped-tensor", ("model.moe_single_grouped_weight", "model.moe_use_grouped_tensor"),  # main pads itself
         lambda s: moe(s) and next(({"lead": p} for p in ("model.moe_use_grouped_tensor",
                                                          "model.moe_single_grouped_weight",
                                                          "model.moe_single_grouped_bias") if s.get(p)), None),
         "{nx[lead]}: TE's GroupedTensor experts pad their own token splits (SNIP's padding would pad twice) and "
         "hold the experts' weights as one parameter, where SNIP plans, measures and applies each expert's "
         "weight<i>", "drop {nx[lead]}",
         example={**MOE, "model.moe_grouped_gemm": True, "model.transformer_impl": "transformer_engine",
                  "run.backend": "te", "model.moe_single_grouped_weight": True,
                  # megatron-core 0.19 asks for TE's op fuser too (refused on its own: te-op-fuser)
                  "model.use_transformer_engine_op_fuser": True}, entries=("megatron-lm", "bridge")),
    Rule("moe-experts-wgrad-overlap", ("model.overlap_dispatch_backward_with_experts_wgrad",),
         lambda s: moe(s) and s.get("model.overlap_dispatch_backward_with_experts_wgrad"),
         "{n[model.overlap_dispatch_backward_with_experts_wgrad]}: TE delays the grouped experts' weight gradients "
         "past their backward, and SNIP's measurement reads each weight gradient in its own backward",
         "{drop[model.overlap_dispatch_backward_with_experts_wgrad]}",
         example={**MOE, "model.moe_grouped_gemm": True, "model.transformer_impl": "transformer_engine",
                  "run.backend": "te", "run.te_installed": True, "model.expert_model_parallel_size": 2,
                  "model.moe_token_dispatcher_type": "alltoall", "model.bf16": True, "run.world_size": 2,
                  "model.overlap_dispatch_backward_with_experts_wgrad": True}, entries=("megatron-lm", "bridge")),
)
