"""A tiny GPT in Megatron-Bridge's own recipe (vanilla GPT, GPTModelProvider), for the bridge
lane's CPU tests and torchrun worker: Llama-like (RMSNorm, SwiGLU, RoPE, GQA), hidden 64,
seq 32, fp32, mock data, no fused CUDA kernels, gloo."""

from __future__ import annotations

import math

import torch

VOCAB = 256
FUSIONS = ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "gradient_accumulation_fusion",
           "apply_rope_fusion", "cross_entropy_loss_fusion", "persist_layer_norm")
"""Fused CUDA kernels, off on CPU."""


def tiny_config(layer_spec=None, *, num_layers: int = 2, iters: int = 8, tp: int = 1, pp: int = 1,
                vpp: "int | None" = None, distributed_optimizer: bool = False, save=None, load=None,
                save_interval: "int | None" = None, seed: int = 1234):
    """The vanilla GPT recipe, shrunk (layer_spec None: Bridge's local spec)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config

    cfg = vanilla_gpt_pretrain_config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = num_layers, 64, 128
    m.num_attention_heads, m.num_query_groups = 4, 2
    m.seq_length = 32
    m.normalization, m.gated_linear_unit, m.activation_func = "RMSNorm", True, torch.nn.functional.silu
    m.position_embedding_type, m.add_bias_linear = "rope", False
    m.transformer_impl, m.transformer_layer_spec = "local", layer_spec or local_layer_spec
    for fusion in FUSIONS:
        setattr(m, fusion, False)
    m.use_cpu_initialization = True
    m.attention_dropout = m.hidden_dropout = 0.0
    m.bf16, m.params_dtype, m.pipeline_dtype = False, torch.float32, torch.float32
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = tp, pp
    m.virtual_pipeline_model_parallel_size = vpp
    cfg.mixed_precision = None
    cfg.rng.seed = seed
    cfg.dataset.seq_length, cfg.dataset.num_workers = 32, 0
    cfg.tokenizer.vocab_size = VOCAB
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = iters, 4, 1
    cfg.validation.eval_interval, cfg.validation.eval_iters = 1000, 0
    cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.bf16 = 3e-3, 3e-4, False
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = distributed_optimizer
    cfg.ddp.grad_reduce_in_fp32 = False
    cfg.scheduler.lr_warmup_iters, cfg.scheduler.lr_decay_iters = 1, iters
    cfg.checkpoint.save, cfg.checkpoint.load = save, load
    cfg.checkpoint.save_interval = save_interval
    cfg.checkpoint.ckpt_format = "torch_dist"
    cfg.logger.tensorboard_dir, cfg.logger.log_interval = None, 1
    cfg.dist.distributed_backend = "gloo"
    return cfg


MLA = dict(q_lora_rank=32, kv_lora_rank=48, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16)
"""Multi-latent attention's widths for the tiny model (as tests/pretrain/test_mla_runs.py's)."""


def tiny_mla_config(*, mtp_num_layers: "int | None" = 1, **kwargs):
    """tiny_config on Bridge's MLAModelProvider (the provider of its DeepSeek/Kimi models): multi-latent
    attention of MLA's widths (every head its own keys: no GQA), plain RoPE, and an MTP layer."""
    import dataclasses

    from megatron.bridge.models.mla_provider import MLAModelProvider

    cfg = tiny_config(**kwargs)
    dense, default = cfg.model, type(cfg.model)()
    # what tiny_config and the recipe set; MLA's own defaults (YaRN's scaling fields ...) stay
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)
              if f.init and getattr(dense, f.name) is not getattr(default, f.name)}
    cfg.model = MLAModelProvider(**{**fields, **MLA, "multi_latent_attention": True, "rope_type": "rope",
                                    "num_query_groups": dense.num_attention_heads, "mtp_num_layers": mtp_num_layers})
    return cfg


QWEN3_MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, qk_layernorm=True,
                 moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3, moe_router_pre_softmax=False,
                 moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32")
"""The MoE fields Bridge's Qwen3-MoE bridge sets (models/qwen/qwen3_moe_bridge.py: aux loss 1e-3, QK
layernorm, the alltoall dispatcher; `norm_topk_prob` true, so no pre-softmax), shrunk to 4 experts,
top-2; every layer MoE, as in Qwen3-MoE. Its fused kernels (grouped GEMM, permute fusion) are CUDA or
TE: off here, so the experts are Megatron's SequentialMLP."""


def tiny_moe_config(**kwargs):
    """tiny_config as a tiny Qwen3-MoE (QWEN3_MOE): Bridge's recipe builds that model from the Hugging
    Face config (AutoBridge), which this machine cannot download; the GPTModelProvider gets its fields."""
    cfg = tiny_config(**kwargs)
    for name, value in QWEN3_MOE.items():
        setattr(cfg.model, name, value)
    cfg.model.moe_grouped_gemm, cfg.model.moe_permute_fusion = False, False
    return cfg


DEEPSEEK_MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                    moe_router_pre_softmax=True, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
                    moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", qk_layernorm=True,
                    share_embeddings_and_output_weights=False)
"""The MoE fields Bridge's DeepSeek-V3 bridge sets on its MLAModelProvider (models/deepseek/deepseek_v3_bridge.py:
sigmoid scores with an expert bias, sequence aux loss, shared experts, the alltoall dispatcher; untied
embeddings and output layer, which its MTP layer on the last pipeline stage needs), shrunk to
4 experts, top-2, one shared expert; every layer MoE (DeepSeek-V3's first dense layers need a decoder
block spec, which Bridge's local spec is not). Its fused kernels (grouped GEMM, permute fusion, shared
expert overlap on CUDA streams) are CUDA or TE: off here, so the experts are Megatron's SequentialMLP."""


def tiny_deepseek_config(*, mtp_num_layers: "int | None" = 1, **kwargs):
    """tiny_mla_config (MLA with an MTP layer) with DeepSeek-V3's MoE (DEEPSEEK_MOE)."""
    cfg = tiny_mla_config(mtp_num_layers=mtp_num_layers, **kwargs)
    for name, value in DEEPSEEK_MOE.items():
        setattr(cfg.model, name, value)
    cfg.model.moe_grouped_gemm, cfg.model.moe_permute_fusion = False, False
    return cfg


def on_te(model, *, layer_spec: bool = True) -> None:
    """The provider's linears on Transformer Engine (Bridge's default TE layer spec, or the hybrid
    stack's own with `layer_spec` False), with Megatron's GPU default of fused wgrad accumulation
    (over the apex double's kernel) and, for an MoE model, grouped experts, which SNIP plans on TE."""
    if layer_spec:
        from megatron.bridge.models.gpt_provider import default_layer_spec

        model.transformer_impl, model.transformer_layer_spec = "transformer_engine", default_layer_spec
    model.gradient_accumulation_fusion = True
    if model.num_moe_experts:
        model.moe_grouped_gemm = True


def tiny_hybrid_config(pattern: str = "*-*-", **kwargs):
    """tiny_config on Bridge's HybridModelProvider: one layer per pattern symbol, over Transformer
    Engine's linears (Megatron's hybrid stack spec is TE-only: on CPU, the TE double)."""
    import dataclasses

    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    from megatron.core.transformer.enums import AttnBackend

    symbols = pattern.replace("|", "")
    cfg = tiny_config(num_layers=len(symbols), **kwargs)
    dense, default = cfg.model, type(cfg.model)()
    names = {f.name for f in dataclasses.fields(HybridModelProvider) if f.init}
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)
              if f.init and f.name in names and getattr(dense, f.name) is not getattr(default, f.name)}
    fields.pop("transformer_layer_spec", None)
    fields.update({fusion: False for fusion in FUSIONS})  # HybridModelProvider's own defaults turn them on
    cfg.model = HybridModelProvider(**{**fields, "hybrid_layer_pattern": pattern, "num_layers": None,
                                       "transformer_impl": "transformer_engine", "vocab_size": VOCAB,
                                       "attention_backend": AttnBackend.auto, "position_embedding_type": "rope",
                                       "gated_linear_unit": True, "activation_func": torch.nn.functional.silu,
                                       "bf16": False, "params_dtype": torch.float32, "pipeline_dtype": torch.float32})
    return cfg


def tiny_recipe():
    """tiny_config as a recipe function (snip-bridge-pretrain --recipe tests.bridge.tiny:tiny_recipe)."""
    return tiny_config(iters=4)


def tiny_qwen3_moe_recipe():
    """tiny_moe_config, two layers, as a recipe function (snip-bridge-pretrain's tests)."""
    return tiny_moe_config(num_layers=2, iters=3)


def tiny_deepseek_te_recipe():
    """tiny_deepseek_config, two layers and an MTP layer, on TE with grouped experts (over the TE
    double), as a recipe function (snip-bridge-pretrain's tests)."""
    cfg = tiny_deepseek_config(num_layers=2, iters=3)
    on_te(cfg.model)
    return cfg


def recorder():
    """A Bridge callback recording each step's loss (last pipeline stage) and the model."""
    from megatron.bridge.training.callbacks import Callback

    class Record(Callback):
        def __init__(self):
            self.losses, self.model = {}, None

        def on_train_start(self, context):
            self.model = context.model

        def on_train_step_end(self, context):
            loss = (context.loss_dict or {}).get("lm loss")
            if loss is not None:
                self.losses[context.state.train_state.step + 1] = float(loss)

    return Record()


def finite(losses) -> bool:
    return all(math.isfinite(x) for x in losses)
