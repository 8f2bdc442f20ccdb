"""What an MoE run cannot do with SNIP yet: the one owner of those reasons, for Megatron-LM's loop
(snip_megatron.pretrain, from its arguments) and the compact loop (snip_megatron.train, from a
namespace of the same names)."""

from __future__ import annotations


def moe_refusals(args) -> list[str]:
    """What an MoE run (--num-experts) cannot do with SNIP yet, one line each naming the flag. SNIP
    plans, measures and re-plans MoE GPTs on Megatron's local spec (SequentialMLP experts with SNIP's
    emulated linears) and on the TE spec with grouped experts (TEGroupedMLP, --moe-grouped-gemm) at one
    process (docs/moe.md)."""
    out = []

    def refuse(when, text):
        if when:
            out.append(text)

    world = int(getattr(args, "world_size", 1) or 1)
    refuse(int(getattr(args, "expert_model_parallel_size", 1) or 1) > 1,
           "--expert-model-parallel-size > 1: SNIP does not yet reduce expert statistics over expert "
           "parallelism; run MoE at --expert-model-parallel-size 1")
    refuse(world > 1, f"--num-experts on {world} processes: SNIP measures MoE models at one process so far "
           "(expert statistics over TP/EP/DP/PP are not reduced yet); run one process, or drop --snip")
    te = args.transformer_impl == "transformer_engine"
    grouped = bool(getattr(args, "moe_grouped_gemm", False))
    refuse(grouped and not te,
           "--moe-grouped-gemm with --transformer-impl local: SNIP runs grouped experts on Transformer "
           "Engine's GroupedLinear only; add --transformer-impl transformer_engine, or drop it (SequentialMLP experts)")
    refuse(te and not grouped,
           "--num-experts with --transformer-impl transformer_engine without --moe-grouped-gemm: SNIP pads "
           "expert token splits for per-module FP8/FP4 on TE's grouped GEMM only; add --moe-grouped-gemm")
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
