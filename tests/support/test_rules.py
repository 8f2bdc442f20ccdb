"""snip_megatron.support: every rule holds on its own example and on none of the runs SNIP serves,
says its reason and fix in each entry's names, and names only settings Megatron-Core's configs have."""

import dataclasses

import pytest

from snip_megatron.support.check import holding, refusal_message, refusals
from snip_megatron.support.names import BridgeNames, CompactNames, MegatronLMNames, names_for
from snip_megatron.support.rules import RULES
from snip_megatron.support.settings import RunFacts, Settings
from tests.support.examples import settings

CASES = [(rule, entry) for rule in RULES for entry in rule.entries]


@pytest.mark.parametrize("rule, entry", CASES, ids=[f"{r.name}-{e}" for r, e in CASES])
def test_each_rule_holds_on_its_example_and_says_it_in_the_entrys_names(rule, entry):
    s = settings(rule.example, entry)
    found = rule.holds(s)
    assert found is not None, (rule.name, entry)
    names = names_for(entry)
    line = rule.text(s, names, found)
    assert "{" not in line and "}" not in line and "; " in line, line
    lead = names.name(rule.reads[0])
    assert lead.split(" (")[0] in line or rule.reads[0].startswith("run."), (lead, line)
    assert line in refusals(s, names, resolved=rule.after_resolve)


def test_a_rule_holds_only_for_the_entries_it_names():
    for rule in RULES:
        for entry in {"megatron-lm", "bridge", "compact"} - set(rule.entries):
            assert rule.holds(settings(rule.example, entry)) is None, (rule.name, entry)


SERVED = {  # runs SNIP serves, and the entries that serve them: no rule holds (refusing one would be a regression)
    "dense": ({}, ("megatron-lm", "bridge", "compact")),
    "dense on TE at TP=2 + SP, PP=2 x VPP=2, CP=2, recompute, distributed optimizer": ({
        "model.transformer_impl": "transformer_engine", "run.backend": "te", "run.te_installed": True,
        "model.tensor_model_parallel_size": 2, "model.sequence_parallel": True,
        "model.pipeline_model_parallel_size": 2, "model.virtual_pipeline_model_parallel_size": 2,
        "model.context_parallel_size": 2, "model.recompute_granularity": "full",
        "ddp.use_distributed_optimizer": True, "run.world_size": 16}, ("megatron-lm", "bridge")),
    "MLA at TP=2 + SP": ({"model.multi_latent_attention": True, "model.kv_lora_rank": 32,
                          "model.tensor_model_parallel_size": 2, "model.sequence_parallel": True},
                         ("megatron-lm", "bridge")),
    "MTP at PP=2": ({"model.mtp_num_layers": 1, "model.pipeline_model_parallel_size": 2}, ("megatron-lm",)),
    "MoE local at EP=2 over DP": ({"model.num_moe_experts": 4, "model.expert_model_parallel_size": 2,
                                   "run.world_size": 2}, ("megatron-lm",)),
    "MoE local at one process": ({"model.num_moe_experts": 4}, ("megatron-lm", "bridge", "compact")),
    "MoE on TE grouped experts at TP=2 + SP, EP=2": ({
        "model.num_moe_experts": 4, "model.moe_grouped_gemm": True, "model.transformer_impl": "transformer_engine",
        "run.backend": "te", "run.te_installed": True, "model.tensor_model_parallel_size": 2,
        "model.sequence_parallel": True, "model.expert_model_parallel_size": 2,
        "model.expert_tensor_parallel_size": 1, "run.world_size": 2}, ("megatron-lm",)),
    "MoE local at expert TP 2 x EP=2 behind the alltoall dispatcher": ({
        "model.num_moe_experts": 4, "model.expert_model_parallel_size": 2, "model.expert_tensor_parallel_size": 2,
        "model.moe_token_dispatcher_type": "alltoall", "run.world_size": 4}, ("megatron-lm",)),
    "MoE on TE grouped experts at TP=2 + SP, expert TP 2 x EP=2, alltoall": ({
        "model.num_moe_experts": 4, "model.moe_grouped_gemm": True, "model.transformer_impl": "transformer_engine",
        "run.backend": "te", "run.te_installed": True, "model.tensor_model_parallel_size": 2,
        "model.sequence_parallel": True, "model.expert_model_parallel_size": 2,
        "model.expert_tensor_parallel_size": 2, "model.moe_token_dispatcher_type": "alltoall",
        "run.world_size": 4}, ("megatron-lm",)),
    "hybrid '*-*-' on TE": ({"run.family": "hybrid", "run.hybrid_pattern": "*-*-", "run.backend": "te",
                             "run.te_installed": True, "model.transformer_impl": "transformer_engine"},
                            ("megatron-lm", "bridge")),
}
SERVED_CASES = [(run, entry) for run, (_, entries) in SERVED.items() for entry in entries]


@pytest.mark.parametrize("run, entry", SERVED_CASES, ids=[f"{r}-{e}" for r, e in SERVED_CASES])
def test_no_rule_holds_on_the_runs_snip_serves(run, entry):
    s = settings(SERVED[run][0], entry)
    assert holding(s) == [] and holding(s, resolved=True) == []


def test_every_named_setting_is_a_field_of_the_configs_it_is_read_from():
    pytest.importorskip("megatron.training.config", reason="Megatron-LM's configs ship with megatron-core >= 0.19")
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.training.config import CheckpointConfig, DistributedInitConfig

    from snip_megatron.config import SnipConfig

    fields = {section: {f.name for f in dataclasses.fields(cls)} for section, cls in (
        ("model", MLATransformerConfig), ("ddp", DistributedDataParallelConfig), ("optimizer", OptimizerConfig),
        ("checkpoint", CheckpointConfig), ("dist", DistributedInitConfig), ("run", RunFacts), ("snip", SnipConfig))}
    bridge_only = {"model.mtp_hybrid_override_pattern",  # HybridModelProvider's field
                   "model.share_embeddings_and_output_weights"}  # GPTModelProvider's (both set in the bridge lane)
    main_only = {"model.mtp_hsm", "model.moe_use_grouped_tensor"}  # fields of Megatron's main, refused ahead
    for rule in RULES:
        for path in set(rule.reads) | rule.placeholders() | set(rule.example):
            section, _, name = path.partition(".")
            assert name in fields[section] or path in bridge_only | main_only, (rule.name, path)


def test_megatron_lm_names_are_the_flags_of_megatrons_parser():
    pytest.importorskip("megatron.training.arguments", reason="megatron.training ships with megatron-core >= 0.19")
    from snip_megatron.support.names import megatron_lm_flags

    flags = set(megatron_lm_flags().values())
    names = MegatronLMNames()
    assert names.name("model.num_moe_experts") == "--num-experts"  # Megatron-LM's renames
    assert names.name("model.fp8") == "--fp8-format" and names.name("model.fp8_param") == "--fp8-param-gather"
    for rule in RULES:
        if "megatron-lm" not in rule.entries:
            continue
        for path in (set(rule.reads) | rule.placeholders()) - {"run.world_size", "run.backend", "run.family"}:
            name = names.name(path)
            assert name in flags or name.endswith("(no Megatron-LM flag)"), (rule.name, path, name)


def test_each_entry_says_how_to_drop_and_set_a_setting():
    assert MegatronLMNames().drop("model.delay_wgrad_compute", True) == "drop --delay-wgrad-compute"
    assert MegatronLMNames().set("model.sequence_parallel", "True") == "--sequence-parallel"
    assert MegatronLMNames().set("model.expert_tensor_parallel_size", "1") == "--expert-tensor-parallel-size 1"
    bridge = BridgeNames()
    assert bridge.drop("model.delay_wgrad_compute", True) == "set model.delay_wgrad_compute=False"
    assert bridge.drop("model.fp8", "e4m3") == "set model.fp8=None"
    assert bridge.set("model.moe_token_dispatcher_type", "allgather") == "model.moe_token_dispatcher_type='allgather'"
    mixed = BridgeNames("bf16_with_fp8_current_scaling_mixed", frozenset({"fp8"}))
    assert mixed.name("model.fp8") == "mixed_precision='bf16_with_fp8_current_scaling_mixed' (its fp8)"
    assert mixed.drop("model.fp8", "hybrid") == "use mixed_precision='bf16_mixed' (or None)"
    assert CompactNames().set("model.transformer_impl", "local") == "--backend emulated"
    assert CompactNames().name("model.tensor_model_parallel_size") == "--tp"


def test_an_entry_raises_one_line_for_one_refusal_and_a_list_for_several():
    assert refusal_message("this run cannot take SNIP as configured", ["a; b"]) == \
        "this run cannot take SNIP as configured: a; b"
    assert refusal_message("head", ["a; b", "c; d"]) == "head:\n  - a; b\n  - c; d"


def test_a_condition_reads_absent_sections_and_fields_as_unset():
    s = Settings(model=object(), snip=None, run=RunFacts(entry="compact"))
    assert s.get("ddp.use_megatron_fsdp") is None and s.num("model.tensor_model_parallel_size") == 1
    with pytest.raises(KeyError, match="unknown settings section 'modle'"):
        s.get("modle.fp8")
