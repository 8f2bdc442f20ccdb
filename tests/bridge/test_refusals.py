"""Every Bridge setting that fights a per-layer plan is refused by enable_snip, naming the field and
the fix; the measurement's limits only where SNIP measures (a pinned plan runs with them)."""

import pytest
import torch

from snip_megatron.config import SnipConfig
from tests.bridge import tiny


def mp(**fields):
    from megatron.bridge.training.mixed_precision import MixedPrecisionConfig

    return MixedPrecisionConfig(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, **fields)


def setter(path, value):
    def apply(cfg):
        obj = cfg
        *parents, name = path.split(".")
        for part in parents:
            obj = getattr(obj, part)
        setattr(obj, name, value() if callable(value) else value)
    return apply


REFUSED = [  # (what is set, the text the refusal must carry)
    ("mixed_precision", "bf16_with_fp8_current_scaling_mixed",
     r"mixed_precision='bf16_with_fp8_current_scaling_mixed': mixed_precision.fp8='hybrid' .*bf16_mixed"),
    ("mixed_precision", "bf16_with_fp8_current_scaling_mixed", r"first_last_layers_bf16=True keeps the first 1 and last 1"),
    ("mixed_precision", "bf16_with_fp8_current_scaling_mixed", r"fp8_param_gather=True stores weights in FP8"),
    ("mixed_precision", "bf16_with_fp8_delayed_scaling_mixed", r"fp8='hybrid' .*recipe 'delayed'"),
    ("mixed_precision", "bf16_with_fp8_subchannel_scaling_mixed", r"fp8='hybrid' .*recipe 'blockwise'"),
    ("mixed_precision", "bf16_with_mxfp8_mixed", r"reuse_grad_buf_for_mxfp8_param_ag=True"),
    ("mixed_precision", "bf16_with_nvfp4_mixed", r"mixed_precision.fp4='e2m1' .*global FP4"),
    ("mixed_precision", "bf16_with_nvfp4_mixed", r"fp4_param_gather=True stores weights in FP4"),
    ("mixed_precision", "nemotron_3_super_bf16_with_nvfp4_mixed", r"last 14 layers in BF16"),
    ("mixed_precision", lambda: mp(num_layers_at_end_in_bf16=2), r"num_layers_at_end_in_bf16=2 keeps layers in BF16"),
    ("mixed_precision", lambda: mp(num_layers_at_start_in_bf16=1), r"num_layers_at_start_in_bf16=1"),
    ("mixed_precision", lambda: mp(fp8_dot_product_attention=True), r"fp8_dot_product_attention"),
    ("model.fp8", "hybrid", r"model.fp8='hybrid' turns on one global FP8 autocast.*set it off"),
    ("model.fp4", "e2m1", r"model.fp4='e2m1'"),
    ("model.fp8_param", True, r"model.fp8_param=True stores weights in FP8"),
    ("model.first_last_layers_bf16", True, r"model.first_last_layers_bf16=True"),
    ("model.fp8_multi_head_attention", True, r"fp8_multi_head_attention"),
    ("ddp.fp8_param_gather", True, r"ddp.fp8_param_gather=True"),
    ("ddp.fp4_param_gather", True, r"ddp.fp4_param_gather=True"),
    ("optimizer.reuse_grad_buf_for_mxfp8_param_ag", True, r"optimizer.reuse_grad_buf_for_mxfp8_param_ag"),
    ("model.use_kitchen", True, r"model.use_kitchen=True"),
    ("model.multi_latent_attention", True, r"model.multi_latent_attention on a GPTModelProvider, which has no "
                                           r"MLA widths .*MLAModelProvider"),
    ("model.use_transformer_engine_full_layer_spec", True, r"full_layer_spec"),
    ("model.transformer_impl", "inference_optimized", r"model.transformer_impl='inference_optimized'"),
    ("model.transformer_impl", "transformer_engine", r"Transformer Engine is not installed here"),
    ("model.cuda_graph_impl", "transformer_engine", r"CUDA graphs"),
    ("model.tp_comm_overlap", True, r"tp_comm_overlap"),
    ("model.delay_wgrad_compute", True, r"delay_wgrad_compute"),
    ("checkpoint.non_persistent_save_interval", 5, r"non_persistent_save_interval.*checkpoint.save_interval"),
    ("peft", object(), r"peft: SNIP plans pretraining"),
]
MEASUREMENT = [  # refused only where SNIP measures
    ("dist.use_torch_fsdp2", True, r"FSDP"),
    ("dataset.dataloader_type", "batch", r"dataloader_type='batch'"),
]


@pytest.mark.parametrize("path, value, message", REFUSED + MEASUREMENT,
                         ids=[f"{p}={v if isinstance(v, (str, int)) else 'set'}" for p, v, _ in REFUSED + MEASUREMENT])
def test_a_conflicting_setting_is_refused_with_its_fix(path, value, message):
    from snip_megatron.bridge import enable_snip

    cfg = tiny.tiny_config()
    setter(path, value)(cfg)
    spec = cfg.model.transformer_layer_spec
    with pytest.raises(ValueError, match=message) as e:
        enable_snip(cfg, SnipConfig(enabled=True))
    assert str(e.value).startswith("this Megatron-Bridge run cannot take SNIP as configured:")
    assert cfg.model.transformer_layer_spec is spec  # nothing was changed


@pytest.mark.parametrize("path, value, message", MEASUREMENT, ids=[p for p, _, _ in MEASUREMENT])
def test_a_pinned_plan_runs_with_the_measurements_limits(tmp_path, path, value, message):
    from snip_megatron.bridge.refusals import refusals
    from snip_megatron.plan import Plan

    Plan.uniform(2, "fp8").save(tmp_path / "plan.json")
    cfg = tiny.tiny_config()
    setter(path, value)(cfg)
    pinned = SnipConfig(enabled=True, plan=str(tmp_path / "plan.json"), pin_plan=True)
    assert refusals(cfg, pinned) == []


def test_a_plain_bf16_recipe_and_the_defaults_pass():
    from snip_megatron.bridge.refusals import refusals

    cfg = tiny.tiny_config()
    assert refusals(cfg, SnipConfig(enabled=True)) == []
    cfg.mixed_precision = "bf16_mixed"
    cfg.model.fp8 = "hybrid"  # bf16_mixed overwrites it with None when pretrain() starts
    assert refusals(cfg, SnipConfig(enabled=True)) == []


def test_every_refusal_is_listed_at_once():
    from snip_megatron.bridge.refusals import refusals

    cfg = tiny.tiny_config()
    cfg.model.fp8, cfg.model.num_moe_experts, cfg.model.delay_wgrad_compute = "e4m3", 2, True
    cfg.model.moe_expert_capacity_factor = 1.0
    assert len(refusals(cfg, SnipConfig(enabled=True))) == 3


def test_the_layouts_of_a_70b_run_are_accepted_while_snip_measures():
    from snip_megatron.bridge.refusals import refusals

    cfg = tiny.tiny_config(tp=2)
    cfg.model.sequence_parallel, cfg.model.context_parallel_size = True, 2
    cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = "full", "uniform", 1
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = True
    assert refusals(cfg, SnipConfig(enabled=True)) == []


def test_a_tiny_qwen3_moe_passes_with_megatron_lms_moe_limits_named_by_model_field(monkeypatch):
    """Megatron-LM's MoE refusals (megatron.moe.moe_refusals, their one owner) read from Bridge's model
    config, each naming the model field; MoE through Bridge runs at one process."""
    from snip_megatron.bridge.refusals import refusals

    snip = SnipConfig(enabled=True)
    assert refusals(tiny.tiny_moe_config(), snip) == []
    cfg = tiny.tiny_moe_config()
    cfg.model.moe_expert_capacity_factor, cfg.model.moe_router_fusion = 1.25, True
    assert sorted(line.split(":")[0] for line in refusals(cfg, snip)) == [
        "model.moe_expert_capacity_factor", "model.moe_router_fusion"]
    cfg = tiny.tiny_moe_config()
    cfg.model.moe_grouped_gemm = True  # on the local spec: TE's grouped experts only
    assert [line.split(":")[0] for line in refusals(cfg, snip)] == [
        "model.moe_grouped_gemm with model.transformer_impl local"]
    cfg.model.transformer_impl = "transformer_engine"  # TE's grouped experts: padded in snip-pretrain-gpt only
    assert any(line.startswith("model.moe_grouped_gemm with model.transformer_impl='transformer_engine': SNIP pads")
               for line in refusals(cfg, snip)), refusals(cfg, snip)
    monkeypatch.setenv("WORLD_SIZE", "2")
    (line,) = refusals(tiny.tiny_moe_config(), snip)
    assert line.startswith("model.num_moe_experts on 2 processes"), line


def test_multi_latent_attention_and_multi_token_prediction_pass_with_megatron_lms_limits():
    """As in Megatron-LM's loop: MLA at TP > 1 needs sequence parallelism, the fused down-projection
    is refused, MTP is refused with pipeline parallelism; otherwise both are planned."""
    from snip_megatron.bridge.refusals import refusals

    snip = SnipConfig(enabled=True)
    assert refusals(tiny.tiny_mla_config(), snip) == []
    assert refusals(tiny.tiny_mla_config(mtp_num_layers=None), snip) == []
    cfg = tiny.tiny_mla_config(tp=2)
    assert [line.split(":")[0] for line in refusals(cfg, snip)] == [
        "model.multi_latent_attention at tensor_model_parallel_size > 1 needs model.sequence_parallel=True"]
    cfg.model.sequence_parallel = True
    assert refusals(cfg, snip) == []
    cfg.model.mla_down_proj_fusion = True
    assert [line.split(":")[0] for line in refusals(cfg, snip)] == ["model.mla_down_proj_fusion"]
    assert [line.split(":")[0] for line in refusals(tiny.tiny_mla_config(pp=2), snip)] == [
        "model.mtp_num_layers with pipeline_model_parallel_size > 1"]


def test_a_hybrid_model_is_refused_where_snip_pretrain_hybrid_refuses_it():
    """HybridModelProvider: SNIP plans '*' and '-' layers over Transformer Engine (the hybrid stack spec is
    TE-only); layer kinds it does not plan, and Mamba layers on a CPU, are refused by name."""
    from snip_megatron.bridge.refusals import hybrid_refusals

    snip = SnipConfig(enabled=True)
    model = tiny.tiny_hybrid_config("*-*-").model
    assert hybrid_refusals(model, "te") == []
    assert hybrid_refusals(model, "emulated") == [
        "HybridModelProvider plans Transformer Engine linears (Megatron's hybrid layer spec is TE-only): set "
        "model.transformer_impl='transformer_engine'"]
    model.hybrid_layer_pattern = "M*-*"
    assert hybrid_refusals(model, "te")[0].startswith("model.hybrid_layer_pattern 'M*-*': Mamba (M) layers run "
                                                      "CUDA kernels")
    model.hybrid_layer_pattern = "*E*E"
    assert hybrid_refusals(model, "te") == [  # refused by name: Bridge lacks SNIP's grouped split padding
        "model.hybrid_layer_pattern '*E*E': MoE layers (E) through Bridge: Megatron's hybrid spec builds TE grouped "
        "experts, whose token splits SNIP pads in snip-pretrain-hybrid only (not through Bridge yet); run "
        "snip-pretrain-hybrid, or use '-' (dense MLP) layers"]
    model.hybrid_layer_pattern, model.mtp_hybrid_override_pattern = "*-*-", "*-"
    assert hybrid_refusals(model, "te")[0].startswith("model.mtp_hybrid_override_pattern")
    cfg = tiny.tiny_hybrid_config("*-*-")
    cfg.model.transformer_impl = "local"
    with pytest.raises(ValueError, match="HybridModelProvider plans Transformer Engine linears"):
        from snip_megatron.bridge import enable_snip

        enable_snip(cfg, snip)
