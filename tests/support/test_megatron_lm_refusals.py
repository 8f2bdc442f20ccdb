"""Every rule Megatron-LM's loop can reach is refused through snip-pretrain-gpt's (or
snip-pretrain-hybrid's) own command line: the flags derived from the rule's example, Megatron's
parser and validation, then SNIP's start-up check, which exits 2 with the rule's line before
anything is built (prod lane: megatron.training ships with megatron-core >= 0.19)."""

import pytest

pytest.importorskip("megatron.training.arguments",
                    reason="megatron.training ships only with megatron-core >= 0.19 (prod lane)")

from snip_megatron.support.names import MegatronLMNames  # noqa: E402
from snip_megatron.support.rules import RULES  # noqa: E402
from tests.support.entry_inputs import TINY_MEGATRON_LM, megatron_lm_input  # noqa: E402
from tests.support.examples import settings  # noqa: E402

CASES = [rule for rule in RULES if "megatron-lm" in rule.entries and megatron_lm_input(rule.example) is not None]


ENV = {"fsdp": {"CUDA_DEVICE_MAX_CONNECTIONS": "2"}}
"""Megatron's FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1, which snip-pretrain-gpt sets on CPU only."""

ARGV = {"weight-shards": ["--global-batch-size", "2"]}
"""Megatron-LM 0.19.2's validation counts generalized TP's ranks as data-parallel in one batch-size
check and as model-parallel in another: a batch both accept."""


@pytest.fixture
def megatron_lm(monkeypatch, capsys):
    """snip-pretrain-gpt's CLI in this process: (exit status, stderr) of its command line; the run
    stops with an AssertionError where SNIP would let it train."""
    import torch
    from megatron.core.transformer import transformer_config
    from megatron.training import arguments, global_vars

    from snip_megatron.errors import run_cli
    from snip_megatron.pretrain import cpu, entry
    from snip_megatron.te import gpu, installed

    def would_train(args):
        raise AssertionError("SNIP's start-up check let this run train")

    monkeypatch.setattr(cpu, "prepare_cpu", would_train)
    ok = installed.Availability(True)
    monkeypatch.setattr(gpu, "current_sm", lambda: 100)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # Megatron asks
    # Megatron's validation asks TE's version for --fp4-format and FP8 parameters: a GPU machine's TE
    monkeypatch.setattr(arguments, "is_te_min_version", lambda version: True)
    # and TransformerConfig's checks of TE's version (MoE GroupedTensor weights, experts' wgrad overlap)
    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda version, check_equality=True: True)

    def run(argv, env, family, te_installed=False, prog=None, main=None, te_version="2.14.0"):
        monkeypatch.setattr(installed, "te_installed", lambda: te_installed)
        monkeypatch.setattr(installed, "installed_version", lambda: te_version if te_installed else None)
        monkeypatch.setattr(installed, "read_te_support", lambda: installed.TESupport(
            version=te_version, fp8=ok, fp8_block_scaling=ok, mxfp8=ok, nvfp4=ok))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        if main is None:
            main = entry.main_hybrid if family == "hybrid" else entry.main
        try:
            status = run_cli(prog or entry.PROGRAMS[family], main, [*TINY_MEGATRON_LM, *argv])
        finally:
            global_vars.unset_global_variables()
            for name in env:
                monkeypatch.delenv(name)
        return status, capsys.readouterr().err

    return run


@pytest.mark.parametrize("rule", CASES, ids=[r.name for r in CASES])
def test_each_rule_is_refused_through_megatron_lms_command_line(megatron_lm, rule):
    argv, env, family = megatron_lm_input(rule.example)
    env.update(ENV.get(rule.name, {}))
    te_installed = rule.example.get("run.te_installed", rule.example.get("run.backend") == "te")
    status, err = megatron_lm(["--snip", *argv, *ARGV.get(rule.name, [])], env, family, te_installed=te_installed,
                              te_version=rule.example.get("run.te_version", "2.14.0"))
    s = settings(rule.example, "megatron-lm")
    line = rule.text(s, MegatronLMNames(), rule.holds(s))
    assert status == 2, err
    error = err[err.index(f"{'snip-pretrain-hybrid' if family == 'hybrid' else 'snip-pretrain-gpt'}: error: "):]
    assert error.startswith(f"{error.split(':')[0]}: error: this Megatron-LM run cannot take SNIP as configured"), err
    assert line in error, (line, err)


ANALYZED = [rule for rule in RULES if "analyze" in rule.entries and megatron_lm_input(rule.example) is not None]


@pytest.mark.parametrize("rule", ANALYZED, ids=[r.name for r in ANALYZED])
def test_each_rule_of_snip_analyze_is_refused_through_its_command_line(megatron_lm, rule, tmp_path):
    """snip-analyze on a checkpoint folder (nothing in it is read before the refusal) with the run's
    flags derived from the rule's example: exit 2 with the rule's line, before Megatron builds anything."""
    from snip_megatron.analyze.cli import main

    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000002").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    argv, env, family = megatron_lm_input(rule.example)
    env.update(ENV.get(rule.name, {}))
    status, err = megatron_lm(["--load", str(ckpt), "--out", str(tmp_path / "out"), *argv], env, family,
                              te_installed=rule.example.get("run.te_installed", False), prog="snip-analyze", main=main,
                              te_version=rule.example.get("run.te_version", "2.14.0"))
    s = settings(rule.example, "analyze")
    assert status == 2, err
    error = err[err.index("snip-analyze: error: "):]
    assert error.startswith("snip-analyze: error: snip-analyze cannot measure this run as configured"), err
    assert rule.text(s, MegatronLMNames(), rule.holds(s)) in error, err
    assert not (tmp_path / "out").exists()
