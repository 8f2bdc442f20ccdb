"""Every rule Megatron-Bridge can reach is refused by enable_snip, through Bridge's own
ConfigContainer: the rule's example set on a tiny recipe's fields, the line naming the field (or the
mixed-precision recipe that sets it) and the fix; nothing of the config is changed. The measurement's
limits hold only where SNIP measures; the runs SNIP serves through Bridge pass."""

import dataclasses

import pytest
import torch

from snip_megatron.config import SnipConfig
from snip_megatron.support.rules import RULES
from tests.bridge import tiny

CASES = [rule for rule in RULES if "bridge" in rule.entries]
RUN_FIELDS = {"run.dataloader_type": "dataset.dataloader_type", "run.full_te_layer":
              "model.use_transformer_engine_full_layer_spec", "run.comm_overlap_tp": "comm_overlap.tp_comm_overlap"}
"""Run facts that are fields of Bridge's ConfigContainer (the others: the model's class, the
machine, the process count)."""


def set_path(cfg, path, value):
    obj = cfg
    *parents, name = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, name, value)


def bridge_input(example: dict, monkeypatch):
    """(ConfigContainer, SnipConfig) of Bridge's entry for a rule's example."""
    from megatron.bridge.models.transformer_config import TransformerConfig

    from snip_megatron.te import installed

    hybrid = example.get("run.family") == "hybrid"
    cfg = tiny.tiny_hybrid_config(example["run.hybrid_pattern"]) if hybrid else tiny.tiny_config()
    snip = {"enabled": True}
    monkeypatch.setattr(installed, "te_installed", lambda: example.get("run.te_installed",
                                                                       example.get("run.backend") == "te" or hybrid))
    if "run.te_version" in example:  # the GPU machine's TE, asked at start-up (rules on its switches)
        from snip_megatron.te import gpu

        ok = installed.Availability(True)
        version = example["run.te_version"]
        monkeypatch.setattr(installed, "installed_version", lambda: version)
        monkeypatch.setattr(installed, "read_te_support", lambda: installed.TESupport(
            version=version, fp8=ok, fp8_block_scaling=ok, mxfp8=ok, nvfp4=ok))
        monkeypatch.setattr(gpu, "current_sm", lambda: 100)
    for path, value in example.items():
        section, _, name = path.partition(".")
        if path == "run.family" and not hybrid:  # another provider than GPT's or the HybridModel's
            model = cfg.model
            kinds = {f.name: getattr(model, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
            cfg.model = type(value, (TransformerConfig,), {})(**kinds)
        elif path == "run.world_size":
            monkeypatch.setenv("WORLD_SIZE", str(value))
        elif path == "run.te_environ":
            for name, setting in value:
                monkeypatch.setenv(name, setting)
        elif path == "run.peft":
            cfg.peft = object()
        elif path in RUN_FIELDS:
            set_path(cfg, RUN_FIELDS[path], value)
        elif section == "snip":
            snip[name] = list(value) if isinstance(value, tuple) else value
        elif section != "run":
            set_path(cfg, path, value)
    return cfg, SnipConfig(**snip)


@pytest.mark.parametrize("rule", CASES, ids=[r.name for r in CASES])
def test_each_rule_is_refused_through_enable_snip_naming_the_field(rule, monkeypatch):
    from snip_megatron.bridge import enable_snip
    from snip_megatron.bridge.settings import settings_of

    cfg, snip = bridge_input(rule.example, monkeypatch)
    s, names = settings_of(cfg, snip)
    line = rule.text(s, names, rule.holds(s))
    spec = cfg.model.transformer_layer_spec if hasattr(cfg.model, "transformer_layer_spec") else None
    with pytest.raises(ValueError) as e:
        enable_snip(cfg, snip)
    assert str(e.value).startswith("this Megatron-Bridge run cannot take SNIP as configured"), e.value
    assert line in str(e.value), (line, str(e.value))
    assert getattr(cfg.model, "transformer_layer_spec", None) is spec  # nothing was changed


def mp(**fields):
    from megatron.bridge.training.mixed_precision import MixedPrecisionConfig

    return MixedPrecisionConfig(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, **fields)


@pytest.mark.parametrize("recipe, says", [
    ("bf16_with_fp8_current_scaling_mixed", [
        "mixed_precision='bf16_with_fp8_current_scaling_mixed' (its fp8)='hybrid': one global FP8 autocast",
        "mixed_precision='bf16_with_fp8_current_scaling_mixed' (its first_last_layers_bf16) keeps the first 1 and last 1"]),
    ("bf16_with_fp8_delayed_scaling_mixed", ["(its fp8_recipe)='delayed' (delayed scaling)"]),
    ("bf16_with_mxfp8_mixed", ["(its reuse_grad_buf_for_mxfp8_param_ag) goes with MXFP8 parameter storage"]),
    ("bf16_with_nvfp4_mixed", ["(its fp4)='e2m1': one global FP4 autocast",
                               "(its fp4_param) : weights stored or gathered in FP4"]),
    ("nemotron_3_super_bf16_with_nvfp4_mixed", ["last 14 layers in BF16"]),
    (lambda: mp(fp8_dot_product_attention=True), ["mixed_precision='MixedPrecisionConfig' "
                                                  "(its fp8_dot_product_attention) runs attention"]),
])
def test_a_mixed_precision_recipe_is_named_for_what_it_sets(recipe, says):
    from snip_megatron.bridge.settings import refused

    cfg = tiny.tiny_config()
    cfg.mixed_precision = recipe() if callable(recipe) else recipe
    lines = refused(cfg, SnipConfig(enabled=True))
    for words in says:
        assert any(words.replace(" : ", ": ") in line for line in lines), (words, lines)
    assert all("use mixed_precision='bf16_mixed' (or None)" in line for line in lines if "(its " in line), lines


MEASUREMENT = [("dist.use_torch_fsdp2", True), ("dataset.dataloader_type", "batch")]


@pytest.mark.parametrize("path, value", MEASUREMENT, ids=[p for p, _ in MEASUREMENT])
def test_a_pinned_plan_runs_with_the_measurements_limits(tmp_path, path, value):
    from snip_megatron.bridge.settings import refused
    from snip_megatron.plan import Plan

    Plan.uniform(2, "fp8").save(tmp_path / "plan.json")
    cfg = tiny.tiny_config()
    set_path(cfg, path, value)
    assert refused(cfg, SnipConfig(enabled=True)) != []
    pinned = SnipConfig(enabled=True, plan=str(tmp_path / "plan.json"), pin_plan=True)
    assert refused(cfg, pinned) == []


def test_a_plain_bf16_recipe_and_the_defaults_pass():
    from snip_megatron.bridge.settings import refused

    cfg = tiny.tiny_config()
    assert refused(cfg, SnipConfig(enabled=True)) == []
    cfg.mixed_precision = "bf16_mixed"
    cfg.model.fp8 = "hybrid"  # bf16_mixed overwrites it with None when pretrain() starts
    assert refused(cfg, SnipConfig(enabled=True)) == []
    assert cfg.model.fp8 == "hybrid"  # the rules read a copy: the user's config is left as it is


def test_every_refusal_is_listed_at_once():
    from snip_megatron.bridge.settings import refused

    cfg = tiny.tiny_config()
    cfg.model.fp8, cfg.model.num_moe_experts, cfg.model.delay_wgrad_compute = "e4m3", 2, True
    cfg.model.moe_expert_capacity_factor = 1.0
    lines = refused(cfg, SnipConfig(enabled=True))
    assert [line.split(":")[0].split("=")[0] for line in lines] == [
        "model.fp8", "model.fp8_recipe", "model.delay_wgrad_compute", "model.moe_expert_capacity_factor"]


@pytest.mark.parametrize("make", [
    lambda: tiny.tiny_config(tp=2), lambda: tiny.tiny_moe_config(), lambda: tiny.tiny_mla_config(),
    lambda: tiny.tiny_mla_config(mtp_num_layers=None, tp=2), lambda: tiny.tiny_hybrid_config("*-*-")],
    ids=["dense-70b-layouts", "qwen3-moe", "mla-mtp", "mla-tp2-sp", "hybrid"])
def test_the_runs_snip_serves_through_bridge_pass(make, monkeypatch):
    from snip_megatron.bridge.settings import refused
    from snip_megatron.te import installed

    monkeypatch.setattr(installed, "te_installed", lambda: True)  # the hybrid stack spec is TE's (the double here)
    cfg = make()
    if cfg.model.tensor_model_parallel_size == 2:
        cfg.model.sequence_parallel, cfg.model.context_parallel_size = True, 2
        cfg.model.transformer_impl = "transformer_engine"  # Megatron's local attention has no CP
        cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = "full", "uniform", 1
        cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = True
    assert refused(cfg, SnipConfig(enabled=True)) == []
