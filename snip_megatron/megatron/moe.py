"""What an MoE run cannot do with SNIP yet: the one owner of those reasons, for Megatron-LM's loop
(snip_megatron.pretrain, from its arguments) and the compact loop (snip_megatron.train, from a
namespace of the same names)."""

from __future__ import annotations


def moe_refusals(args) -> list[str]:
    """What an MoE run (--num-experts) cannot do with SNIP yet, one line each naming the flag. SNIP
    plans, measures and re-plans MoE GPTs on Megatron's local spec (SequentialMLP experts with SNIP's
    emulated linears) at one process and at expert, pipeline and data parallelism, and on the TE spec
    with grouped experts (TEGroupedMLP, --moe-grouped-gemm) at one process, TP=2 with sequence
    parallelism and EP=2, EP over DP and PP, expert TP 1 (docs/moe.md)."""
    out = []

    def refuse(when, text):
        if when:
            out.append(text)

    world = int(getattr(args, "world_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or getattr(args, "tensor_model_parallel_size", 1) or 1)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    te = args.transformer_impl == "transformer_engine"
    grouped = bool(getattr(args, "moe_grouped_gemm", False))
    refuse(grouped and not te,
           "--moe-grouped-gemm with --transformer-impl local: SNIP runs grouped experts on Transformer "
           "Engine's GroupedLinear only; add --transformer-impl transformer_engine, or drop it (SequentialMLP experts)")
    refuse(te and not grouped,
           "--num-experts with --transformer-impl transformer_engine without --moe-grouped-gemm: SNIP pads "
           "expert token splits for per-module FP8/FP4 on TE's grouped GEMM only; add --moe-grouped-gemm")
    refuse(te and world > 1 and tp > 1 and etp > 1,
           f"--expert-tensor-parallel-size {etp} with --transformer-impl transformer_engine experts on {world} "
           "processes: SNIP's grouped-expert measurement runs each expert's GEMM whole, and TE grouped experts are "
           "tested at expert TP 1 only (TP=2 with --sequence-parallel, EP over DP, PP); add "
           "--expert-tensor-parallel-size 1")
    refuse(not te and tp > 1, "--tensor-model-parallel-size > 1 with --num-experts on --transformer-impl local: "
           "Megatron's MoE layer trains at TP > 1 only with --sequence-parallel, and the local spec builds RMSNorm "
           "(and LayerNorm without apex) as a torch norm, which refuses it; run MoE at --tensor-model-parallel-size 1 "
           "(expert and data parallelism), or on --transformer-impl transformer_engine --moe-grouped-gemm")
    refuse(tp == 1 and etp > 1, "--expert-tensor-parallel-size > 1 with --num-experts: SNIP measures expert TP "
           "(tested at ETP = TP = 2), but no run at expert TP is tested yet; run MoE at --expert-tensor-parallel-size 1")
    refuse(int(getattr(args, "context_parallel_size", 1) or 1) > 1,
           "--context-parallel-size > 1 with --num-experts: SNIP does not measure experts over context "
           "parallelism yet (untested); run MoE at --context-parallel-size 1")
    refuse(getattr(args, "num_layers_per_virtual_pipeline_stage", None) or getattr(args, "num_virtual_stages_per_pipeline_rank", None),
           "--num-layers-per-virtual-pipeline-stage with --num-experts: SNIP does not measure MoE under the "
           "interleaved pipeline schedule yet (untested); drop it")
    dispatcher = getattr(args, "moe_token_dispatcher_type", "allgather")
    refuse(ep * etp > 1 and dispatcher != "allgather" and not _cuda(),
           f"--moe-token-dispatcher-type {dispatcher} on CPU: Megatron's {dispatcher} dispatcher hands gloo its "
           "all-to-all split sizes as tensors (it turns them into lists only off a GPU copy); use "
           "--moe-token-dispatcher-type allgather")
    refuse(getattr(args, "moe_router_fusion", False),
           "--moe-router-fusion: the fused top-k bypasses Megatron's router-replay hook, which SNIP uses to "
           "keep routing fixed across its measurement passes; drop it")
    balancing = getattr(args, "moe_router_load_balancing_type", "aux_loss")
    balancing = [balancing] if isinstance(balancing, str) else list(balancing or [])
    odd = [b for b in balancing if b in ("sinkhorn", "quantile_balancing")]
    refuse(odd, f"--moe-router-load-balancing-type {' '.join(odd)}: routes without Megatron's top-k replay "
           "hook, so SNIP cannot freeze routing while it measures; use aux_loss, seq_aux_loss, global_aux_loss or none")
    refuse(getattr(args, "moe_expert_capacity_factor", None) is not None,
           "--moe-expert-capacity-factor: token dropping follows the routing probabilities, which SNIP's "
           "noise passes change; drop it (dropless MoE)")
    refuse(getattr(args, "moe_latent_size", None),
           "--moe-latent-size: SNIP does not plan the latent projections yet; drop it")
    refuse(getattr(args, "mtp_num_layers", None),
           "--mtp-num-layers with --num-experts: SNIP plans MoE layers in the decoder, not in "
           "multi-token-prediction layers yet; drop one of them")
    return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
