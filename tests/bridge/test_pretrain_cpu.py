"""Megatron-Bridge's own pretrain() trains a tiny GPT (GPTModelProvider, the vanilla recipe) on CPU
in this process: Megatron's local layers, then SNIP's emulated linears under a fixed plan that
reaches the model through `quant_recipe`, as a Bridge recipe sets it. No SNIP controller yet."""

import math

import pytest
import torch

from snip_megatron.plan import LayerKey, Plan

NUM_LAYERS = 2
ITERS = 8
# Fixed plan: FP8 everywhere, the second layer's MLP in NVFP4 (emulated).
PLAN = Plan.uniform(NUM_LAYERS, "fp8").replace({LayerKey(2, "linear_fc1"): "fp4",
                                                 LayerKey(2, "linear_fc2"): "fp4"})


def snip_layer_spec(config, vp_stage=None):
    """Transformer-layer spec for GPTModelProvider: it calls this once per model chunk right before
    building it, so the chunk's quant_recipe is set here (a module-level function: picklable)."""
    from snip_megatron.megatron.quant_recipe import recipe_for_chunk
    from snip_megatron.megatron.spec import get_snip_layer_spec

    config.quant_recipe = recipe_for_chunk(PLAN, config, vp_stage=vp_stage, backend="emulated")
    return get_snip_layer_spec(config.normalization)


def tiny_config(layer_spec):
    """The vanilla GPT recipe, shrunk: 2 layers x 64 wide, Llama-like (RMSNorm, SwiGLU, RoPE), fp32,
    mock data, no checkpoints, no evaluation, no fused CUDA kernels."""
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config

    cfg = vanilla_gpt_pretrain_config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads = NUM_LAYERS, 64, 128, 4
    m.seq_length = 64
    m.normalization, m.gated_linear_unit, m.activation_func = "RMSNorm", True, torch.nn.functional.silu
    m.position_embedding_type = "rope"
    m.transformer_impl, m.transformer_layer_spec = "local", layer_spec
    for fusion in ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                   "gradient_accumulation_fusion", "apply_rope_fusion", "cross_entropy_loss_fusion",
                   "persist_layer_norm"):
        setattr(m, fusion, False)
    m.use_cpu_initialization = True
    m.bf16, m.params_dtype, m.pipeline_dtype = False, torch.float32, torch.float32
    cfg.mixed_precision = None
    cfg.dataset.seq_length, cfg.dataset.num_workers = 64, 0
    cfg.tokenizer.vocab_size = 256
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = ITERS, 4, 2
    cfg.validation.eval_interval, cfg.validation.eval_iters = 1000, 0
    cfg.optimizer.lr, cfg.optimizer.bf16 = 3e-3, False
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    cfg.ddp.grad_reduce_in_fp32 = False
    cfg.scheduler.lr_warmup_iters, cfg.scheduler.lr_decay_iters = 1, ITERS
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir, cfg.logger.log_interval = None, 1
    cfg.dist.distributed_backend = "gloo"
    return cfg


def run_pretrain(cfg):
    """pretrain() with a callback recording each step's loss and the model it trained."""
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    seen = {"losses": [], "model": None}

    class Record(Callback):
        def on_train_start(self, context):
            seen["model"] = context.model

        def on_train_step_end(self, context):
            seen["losses"].append(float(context.loss_dict["lm loss"]))

    pretrain(cfg, forward_step, callbacks=[Record()])
    return seen


def assert_trained(losses):
    assert len(losses) == ITERS and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(256), abs=0.5)  # starts near uniform over the vocab
    assert losses[-1] < losses[0] - 0.2, losses


def test_vanilla_gpt_trains_in_bridge_pretrain(bridge_on_cpu):
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    seen = run_pretrain(tiny_config(local_layer_spec))
    assert_trained(seen["losses"])
    layers = [m for m in seen["model"][0].modules() if isinstance(m, TransformerLayer)]
    assert len(layers) == NUM_LAYERS
    assert not any("transformer_engine" in type(m).__module__ for m in seen["model"][0].modules())


def test_snip_emulated_linears_train_under_a_fixed_plan(bridge_on_cpu):
    from snip_megatron.emulation.parallel_linear import (QuantColumnParallelLinear,
                                                         QuantRowParallelLinear)
    from snip_megatron.megatron.apply import current_plan, list_planned_linears

    seen = run_pretrain(tiny_config(snip_layer_spec))
    assert_trained(seen["losses"])
    planned = list_planned_linears(seen["model"])
    assert len(planned) == 4 * NUM_LAYERS
    assert all(isinstance(pl.module, (QuantColumnParallelLinear, QuantRowParallelLinear))
               for pl in planned)
    assert current_plan(seen["model"]) == PLAN  # the plan the quant_recipe carried, after training
