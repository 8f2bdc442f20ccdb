"""Rules on Megatron features that would keep a re-plan from reaching the GEMMs, or keep SNIP's
measurement from reading what it reads (each linear's whole weight and gradient in an ordinary
backward), or lose SNIP's state."""

from __future__ import annotations

from snip_megatron.support.rule import Rule

PIN = "or pin a plan ({n[snip.plan]} PATH {n[snip.pin_plan]})"


def measures(s) -> bool:
    """SNIP measures in this run (a min-rel-error baseline measures its errors too)."""
    return s.snip.measures or s.snip.baseline == "min_rel_error"


def _cuda_graphs(s) -> bool:
    return (s.get("model.cuda_graph_impl", "none") not in (None, "none") or bool(s.get("model.enable_cuda_graph"))
            or bool(s.get("model.external_cuda_graph")))


def _weight_shards(s):
    """{"lead": the setting} when Megatron's generalized TP shards weights beyond the TP group."""
    for shards, tp in (("model.tensor_parallel_num_weight_shards", "model.tensor_model_parallel_size"),
                       ("model.expert_tensor_parallel_num_weight_shards", "model.expert_tensor_parallel_size")):
        value = s.get(shards)
        if value is not None and int(value) > s.num(tp, s.num("model.tensor_model_parallel_size")):
            return {"lead": shards}
    return None


def _offloading(s):
    if s.get("model.cpu_offloading") or s.num("model.cpu_offloading_num_layers", 0) > 0:
        return {"lead": "model.cpu_offloading_num_layers"}  # Megatron-LM's flag turns cpu_offloading on
    return {"lead": "model.fine_grained_activation_offloading"} if s.get("model.fine_grained_activation_offloading") \
        else None


def _fsdp(s):
    lead = next((p for p in ("ddp.use_megatron_fsdp", "dist.use_torch_fsdp2", "dist.use_megatron_fsdp")
                 if s.get(p)), None)
    return {"lead": lead} if lead and measures(s) else None


RULES = (
    Rule("te-op-fuser", ("model.use_transformer_engine_op_fuser",),
         lambda s: s.get("model.use_transformer_engine_op_fuser"),
         "{n[model.use_transformer_engine_op_fuser]}: its fused MLP (and expert) ops ignore per-module recipes, so "
         "the plan would not reach them", "{drop[model.use_transformer_engine_op_fuser]}",
         example={"model.use_transformer_engine_op_fuser": True}),
    Rule("te-full-layer-spec", ("run.full_te_layer",), lambda s: s.run.full_te_layer,
         "{n[run.full_te_layer]}: TE's fused TransformerLayer has no planned linears", "{drop[run.full_te_layer]}",
         example={"run.full_te_layer": True}, entries=("bridge",)),
    Rule("cuda-graphs", ("model.cuda_graph_impl", "model.enable_cuda_graph"), _cuda_graphs,
         "CUDA graphs ({n[model.cuda_graph_impl]} / {n[model.enable_cuda_graph]}) capture one precision per "
         "layer, and SNIP re-plans", "use {set[model.cuda_graph_impl]:none}",
         example={"model.cuda_graph_impl": "local"}),
    Rule("tp-comm-overlap", ("model.tp_comm_overlap",),
         lambda s: s.get("model.tp_comm_overlap") or s.run.comm_overlap_tp,
         "{n[model.tp_comm_overlap]} (Transformer Engine userbuffers) keeps communication buffers of one precision "
         "per layer, so a re-plan cannot switch it", "{drop[model.tp_comm_overlap]}",
         example={"model.tp_comm_overlap": True, "model.tensor_model_parallel_size": 2, "model.sequence_parallel": True,
                  "run.world_size": 2}),
    Rule("delay-wgrad", ("model.delay_wgrad_compute",), lambda s: s.get("model.delay_wgrad_compute"),
         "{n[model.delay_wgrad_compute]}: SNIP's measurement reads each weight gradient in its own backward",
         "{drop[model.delay_wgrad_compute]}", example={"model.delay_wgrad_compute": True, "model.transformer_impl": "transformer_engine",
                  "run.backend": "te", "run.te_installed": True,
                  # Megatron delays the weight gradients only to overlap MoE all-to-alls (TransformerConfig)
                  "model.num_moe_experts": 4, "model.moe_grouped_gemm": True, "model.expert_model_parallel_size": 2,
                  "model.moe_token_dispatcher_type": "alltoall", "model.overlap_moe_expert_parallel_comm": True,
                  "model.bf16": True, "run.world_size": 2}),
    Rule("peft", ("run.peft",), lambda s: s.run.peft,
         "{n[run.peft]}: SNIP plans pretraining; PEFT wraps the planned linears and freezes them",
         "run without SNIP, or without peft", example={"run.peft": True}, entries=("bridge",)),
    Rule("non-persistent-checkpoints", ("checkpoint.non_persistent_save_interval",),
         lambda s: s.get("checkpoint.non_persistent_save_interval"),
         "{n[checkpoint.non_persistent_save_interval]}: SNIP writes its state beside persistent checkpoints only, "
         "so a resume from a non-persistent one would lose the plan",
         "{drop[checkpoint.non_persistent_save_interval]} (use the persistent save interval)",
         example={"checkpoint.non_persistent_save_interval": 10}),
    Rule("cp-local-attention", ("model.context_parallel_size", "model.transformer_impl"),
         lambda s: s.num("model.context_parallel_size") > 1 and s.get("model.transformer_impl") == "local",
         "{nv[model.context_parallel_size]} with {n[model.transformer_impl]} local: Megatron's local attention has no "
         "context parallelism (megatron/core/transformer/dot_product_attention.py asserts context_parallel_size == 1)",
         "use Transformer Engine's attention ({set[model.transformer_impl]:transformer_engine}), or "
         "{set[model.context_parallel_size]:1}", example={"model.context_parallel_size": 2, "run.world_size": 2},
         entries=("megatron-lm", "bridge")),
    Rule("fsdp", ("ddp.use_megatron_fsdp", "dist.use_torch_fsdp2"), _fsdp,
         # Megatron FSDP v2 (main's --megatron-fsdp-version 2) needs --use-megatron-fsdp: refused here too
         "{nx[lead]} (FSDP): SNIP's measurement reads each linear's full weight",
         "use the distributed optimizer instead, " + PIN, example={"ddp.use_megatron_fsdp": True, "checkpoint.ckpt_format": "fsdp_dtensor"}),
    Rule("batch-dataloader", ("run.dataloader_type",),
         lambda s: measures(s) and s.run.dataloader_type == "batch",
         "{n[run.dataloader_type]} 'batch' (variable-length finetuning batches): SNIP measures on pretraining "
         "micro-batches", PIN, example={"run.dataloader_type": "batch"}, entries=("bridge",)),
    Rule("non-adam-optimizer", ("optimizer.optimizer",),
         lambda s: measures(s) and s.get("optimizer.optimizer", "adam") not in (None, "adam"),
         "{nv[optimizer.optimizer]}: SNIP's weight divergence reads Adam's second moments (exp_avg_sq), which "
         "this optimizer does not keep (Megatron's layer-wise distributed optimizer included)",
         "use {set[optimizer.optimizer]:adam}, " + PIN, example={"optimizer.optimizer": "sgd"},
         entries=("megatron-lm", "bridge")),
    Rule("weight-shards", ("model.tensor_parallel_num_weight_shards", "model.expert_tensor_parallel_num_weight_shards"),
         _weight_shards,
         "{nx[lead]} above the tensor-parallel size (generalized TP): a linear's weight would reach SNIP's GEMM "
         "and its measurement as a shard of the TP shard", "drop {nx[lead]}",
         example={"model.tensor_parallel_num_weight_shards": 2, "run.world_size": 2}, entries=("megatron-lm", "bridge")),
    Rule("freeze-all-layers", ("run.freeze_all_layers",), lambda s: s.run.freeze_all_layers,
         "{n[run.freeze_all_layers]}: Megatron runs forward-only steps (nothing SNIP plans trains) and resumes "
         "weights-only, finetune-style, where SNIP resumes its plan with the weights",
         "run without SNIP, or {drop[run.freeze_all_layers]}", example={"run.freeze_all_layers": True},
         entries=("megatron-lm",)),
    Rule("activation-offloading", ("model.cpu_offloading_num_layers", "model.fine_grained_activation_offloading"),
         _offloading,
         "{nx[lead]}: Megatron offloads the inputs of TE's and its own modules through its offload hooks, which "
         "SNIP's linears and measurement passes do not go through", "drop {nx[lead]}",
         example={"model.cpu_offloading_num_layers": 1},
         entries=("megatron-lm", "bridge")),
    Rule("fp32-residual", ("model.fp32_residual_connection",), lambda s: s.get("model.fp32_residual_connection"),
         "{n[model.fp32_residual_connection]}: the norms hand the FP32 residual stream to the planned linears "
         "(megatron-core 0.19; Megatron's main casts it for TE's fused norm only), which SNIP's linears and its "
         "measurement's views of them run in the weights' BF16", "{drop[model.fp32_residual_connection]}",
         example={"model.fp32_residual_connection": True, "model.bf16": True}, entries=("megatron-lm", "bridge")),
)
