"""The Megatron-Bridge settings a SNIP run cannot honour, one line each with the field and the fix.

A per-layer plan needs every planned linear free to run BF16, FP8 or FP4 and to switch between
them: Bridge's global FP8/FP4 (its mixed-precision recipes or the model's own fields), fixed
BF16 layers, FP8/FP4 parameter storage and CUDA graphs fight that. The measurement also reads
each linear's full weight and gradient in an ordinary backward, which some features change.
`refusals` reads the ConfigContainer only; it is run by `enable_snip` and again on the final
model config right before the model is built (Bridge applies the mixed-precision recipe in between).
"""

from __future__ import annotations

BACKENDS = ("emulated", "te")
"""Planned-linear backends: SNIP's emulated linears (model.transformer_impl='local') or Megatron's
Transformer Engine linears planned through quant_recipe (model.transformer_impl='transformer_engine')."""

_FIX_MP = ("use mixed_precision='bf16_mixed' (or None); SNIP chooses FP8/FP4 per layer "
           "(SnipConfig.precisions, initial_precision)")


def backend_of(model) -> str:
    """emulated for Megatron's local layers, te for its Transformer Engine layers."""
    return "te" if getattr(model, "transformer_impl", None) == "transformer_engine" else "emulated"


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # absent, or a broken install (it raises RuntimeError without CUDA)
        return False
    return True


def mixed_precision_of(cfg):
    """cfg.mixed_precision as a MixedPrecisionConfig (a recipe name resolved, cfg unchanged), or None."""
    mp = getattr(cfg, "mixed_precision", None)
    if isinstance(mp, str):
        from megatron.bridge.training.mixed_precision import get_mixed_precision_config

        return get_mixed_precision_config(mp)  # a fresh object: cfg keeps its string
    return mp


def precision_fields(obj, where: str) -> list[str]:
    """The global FP8/FP4 and BF16-layer settings of a model or mixed-precision config."""
    out = []

    def refuse(when, text):
        if when:
            out.append(text)

    get = lambda name, default=None: getattr(obj, name, default)  # noqa: E731
    refuse(get("fp8"), f"{where}.fp8={get('fp8')!r} turns on one global FP8 autocast (recipe "
           f"{get('fp8_recipe')!r}), which fights SNIP's per-layer plan")
    refuse(get("fp4"), f"{where}.fp4={get('fp4')!r} turns on one global FP4 autocast (recipe "
           f"{get('fp4_recipe')!r}), which fights SNIP's per-layer plan")
    for name in ("fp8_param", "fp8_param_gather", "fp4_param", "fp4_param_gather"):
        refuse(get(name), f"{where}.{name}=True stores weights in {name[:3].upper()}, so a layer "
               "cannot change precision")
    refuse(get("reuse_grad_buf_for_mxfp8_param_ag"), f"{where}.reuse_grad_buf_for_mxfp8_param_ag=True "
           "goes with MXFP8 parameter storage, so a layer cannot change precision")
    refuse(get("first_last_layers_bf16"), f"{where}.first_last_layers_bf16=True keeps the first "
           f"{get('num_layers_at_start_in_bf16')} and last {get('num_layers_at_end_in_bf16')} layers "
           "in BF16 by rule (the planner decides instead; SnipConfig.baseline='first_last_k' is that rule)")
    if not get("first_last_layers_bf16") and where == "mixed_precision":
        # On the model config these counts act only with first_last_layers_bf16 (their default there is 1).
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            refuse(get(name, 0), f"{where}.{name}={get(name)} keeps layers in BF16 by rule")
    refuse(get("fp8_dot_product_attention") or get("fp8_multi_head_attention"),
           f"{where}.fp8_dot_product_attention / fp8_multi_head_attention run attention under a "
           "global FP8 autocast")
    return out


def is_hybrid(model) -> bool:
    """Whether a Bridge model config builds a HybridModel (HybridModelProvider, megatron-core 0.18+)."""
    try:
        from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    except ImportError:
        return False
    return isinstance(model, HybridModelProvider)


def hybrid_refusals(model, backend: str) -> list[str]:
    """What a HybridModelProvider run cannot do with SNIP, as snip-pretrain-hybrid refuses it
    (pretrain.setup.hybrid_refusals: layer kinds SNIP does not plan, SNIP's emulated linears, Mamba
    and GDN layers on a CPU), and the MTP part of a Bridge hybrid pattern."""
    from snip_megatron.pretrain.setup import hybrid_refusals as refused

    if getattr(model, "mtp_hybrid_override_pattern", None):
        return ["model.mtp_hybrid_override_pattern (multi-token prediction of a HybridModel): SNIP does not "
                "plan MTP layers of a HybridModel yet; set it None"]
    pattern = model.hybrid_layer_pattern or model.hybrid_override_pattern
    out = refused(pattern, backend, entry="HybridModelProvider", field="model.hybrid_layer_pattern",
                  te_fix="set model.transformer_impl='transformer_engine'")
    if isinstance(pattern, str) and "E" in pattern:
        # Megatron's hybrid spec builds TE grouped experts only, and their split padding
        # (megatron/grouped_padding.py) is put in by the step seam of snip-pretrain-hybrid/-gpt only
        out.insert(0, f"model.hybrid_layer_pattern {pattern!r}: MoE layers (E) through Bridge: Megatron's hybrid "
                      "spec builds TE grouped experts, whose token splits SNIP pads in snip-pretrain-hybrid only "
                      "(not through Bridge yet); run snip-pretrain-hybrid, or use '-' (dense MLP) layers")
    return out


def refusals(cfg, snip, backend: "str | None" = None) -> list[str]:
    """Every setting of `cfg` this SNIP run cannot honour (empty: nothing to change)."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    model = cfg.model
    hybrid = is_hybrid(model)
    if not hybrid and not isinstance(model, GPTModelProvider):
        return [f"model is a {type(model).__name__}: SNIP plans GPT models built by GPTModelProvider "
                "(the gpt, llama, qwen ... recipes; MLAModelProvider's multi-latent attention) and HybridModels "
                "built by HybridModelProvider"]
    backend = backend or backend_of(model)
    out = hybrid_refusals(model, backend) if hybrid else []

    def refuse(when, text):
        if when:
            out.append(text)

    # A mixed-precision config overwrites the model's, DDP's and optimizer's fields of the same
    # names when pretrain() starts (MixedPrecisionConfig.setup): its values are the ones that act.
    mp = mixed_precision_of(cfg)
    if mp is not None:
        name = cfg.mixed_precision if isinstance(cfg.mixed_precision, str) else "MixedPrecisionConfig"
        out += [f"mixed_precision={name!r}: {line}; {_FIX_MP}" for line in precision_fields(mp, "mixed_precision")]
    else:
        out += [f"{line}; set it off ({_FIX_MP})" for line in precision_fields(model, "model")]
        for section in ("ddp", "optimizer"):
            obj = getattr(cfg, section, None)
            for name in ("fp8_param_gather", "fp4_param_gather", "reuse_grad_buf_for_mxfp8_param_ag"):
                refuse(getattr(obj, name, False), f"{section}.{name}=True stores or gathers weights in "
                       "FP8/FP4, so a layer cannot change precision; set it False")
    refuse(getattr(model, "use_kitchen", False), "model.use_kitchen=True quantizes through NVIDIA "
           "Kitchen instead of SNIP's plan; set it False")

    if getattr(model, "num_moe_experts", None):
        out += moe_refusals(model)
    # Multi-latent attention and multi-token prediction are planned as in Megatron-LM's loop
    # (pretrain.setup.refusals), with the same limits.
    mla = getattr(model, "multi_latent_attention", False)
    refuse(mla and not hasattr(model, "kv_lora_rank"), "model.multi_latent_attention on a "
           f"{type(model).__name__}, which has no MLA widths (kv_lora_rank, qk_head_dim, ...): use "
           "megatron.bridge.models.mla_provider.MLAModelProvider (or a provider derived from it)")
    refuse(mla and getattr(model, "mla_down_proj_fusion", False), "model.mla_down_proj_fusion: SNIP plans "
           "multi-latent attention's separate q/kv down-projections; set it False")
    refuse(mla and (model.tensor_model_parallel_size or 1) > 1 and not getattr(model, "sequence_parallel", False),
           "model.multi_latent_attention at tensor_model_parallel_size > 1 needs model.sequence_parallel=True: "
           "without it Megatron's MLA takes the shared rotary key's gradient from each rank's own heads, so "
           "TP ranks train another model than one process (snip_megatron/megatron/mla.py)")
    refuse(getattr(model, "mtp_num_layers", None) and (model.pipeline_model_parallel_size or 1) > 1,
           "model.mtp_num_layers with pipeline_model_parallel_size > 1: SNIP plans multi-token prediction through "
           "Bridge at one pipeline stage so far (snip-pretrain-gpt plans it with PP); set one of them back")
    refuse(getattr(model, "use_transformer_engine_full_layer_spec", False), "model.use_transformer_engine_"
           "full_layer_spec: TE's fused TransformerLayer has no planned linears; set it False")
    impl = getattr(model, "transformer_impl", None)
    refuse(impl not in ("local", "transformer_engine"), f"model.transformer_impl={impl!r}: SNIP needs "
           "'local' (SNIP's emulated linears) or 'transformer_engine' (TE linears planned per module)")
    refuse(backend == "te" and not te_available(), "model.transformer_impl='transformer_engine': "
           "Transformer Engine is not installed here; " + (
               "install it (Megatron's hybrid stack spec is TE-only)" if hybrid else
               "use model.transformer_impl='local' (SNIP's emulated linears) with "
               "model.transformer_layer_spec=local_layer_spec"))
    refuse(getattr(model, "cuda_graph_impl", "none") not in (None, "none")
           or getattr(model, "enable_cuda_graph", False) or getattr(model, "external_cuda_graph", False),
           "CUDA graphs (model.cuda_graph_impl / enable_cuda_graph) capture one precision per layer; "
           "SNIP re-plans: set cuda_graph_impl='none'")
    comm = getattr(cfg, "comm_overlap", None)
    refuse(getattr(model, "tp_comm_overlap", False) or getattr(comm, "tp_comm_overlap", False),
           "tp_comm_overlap (Transformer Engine userbuffers) does not support per-layer precision "
           "switching; set model.tp_comm_overlap / comm_overlap.tp_comm_overlap False")
    refuse(getattr(model, "delay_wgrad_compute", False), "model.delay_wgrad_compute: SNIP's measurement "
           "reads each weight gradient in its own backward; set it False")
    refuse(getattr(cfg, "peft", None) is not None, "peft: SNIP plans pretraining; PEFT wraps the "
           "planned linears and freezes them. Run without SNIP, or without peft")

    ckpt = cfg.checkpoint
    refuse(getattr(ckpt, "non_persistent_save_interval", None), "checkpoint.non_persistent_save_interval: "
           "SNIP writes its state beside persistent checkpoints only, so a resume from a non-persistent "
           "one would lose the plan; use checkpoint.save_interval")

    measures = snip.measures or snip.baseline == "min_rel_error"
    fix = "or pin a plan (snip.plan=PATH snip.pin_plan=true)"
    # Sequence and context parallelism and activation recompute are measured as on Megatron-LM
    # (stats/measure.py; docs/method.md section 10).
    dist = getattr(cfg, "dist", None)
    refuse(measures and (getattr(dist, "use_megatron_fsdp", False) or getattr(dist, "use_torch_fsdp2", False)
                         or getattr(cfg.ddp, "use_megatron_fsdp", False)),
           f"FSDP (dist.use_megatron_fsdp / use_torch_fsdp2): SNIP's measurement reads each linear's "
           f"full weight; use the distributed optimizer instead, {fix}")
    refuse(measures and getattr(cfg.dataset, "dataloader_type", None) == "batch", "dataset.dataloader_type="
           f"'batch' (variable-length finetuning batches): SNIP measures on pretraining micro-batches; {fix}")
    return out


def moe_refusals(model) -> list[str]:
    """What an MoE model config (model.num_moe_experts) cannot do with SNIP: Megatron-LM's refusals
    (megatron.moe.moe_refusals, their one owner) read from the model config, whose fields have the
    arguments' names but for `num_experts`, each line naming the model field instead of the flag.
    Bridge runs SNIP's MoE at one process so far (its tests cover that only)."""
    import os
    import re
    import types

    from snip_megatron.megatron import moe

    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = types.SimpleNamespace(**{**vars(model), "num_experts": model.num_moe_experts, "world_size": world})
    out = [re.sub(r"--([a-z0-9-]+)", lambda m: "model." + ("num_moe_experts" if m.group(1) == "num-experts"
                                                          else m.group(1).replace("-", "_")), line)
           for line in moe.moe_refusals(args)]
    if getattr(model, "moe_grouped_gemm", False) and getattr(model, "transformer_impl", None) == "transformer_engine":
        # the split padding TE's grouped FP8/FP4 GEMMs need (megatron/grouped_padding.py) is put in
        # by snip-pretrain-gpt's step seam only
        out.append("model.moe_grouped_gemm with model.transformer_impl='transformer_engine': SNIP pads grouped "
                   "experts' token splits in snip-pretrain-gpt only so far; set model.moe_grouped_gemm=False "
                   "with model.transformer_impl='local' (SequentialMLP experts)")
    if world > 1 and not any("processes" in line for line in out):
        out.append(f"model.num_moe_experts on {world} processes: SNIP runs MoE through Bridge at one process "
                   "so far (snip-pretrain-gpt runs it at more); run one process, or without SNIP")
    return out
