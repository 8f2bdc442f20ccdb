"""Every rule the compact loop can reach is refused through its own command line
(`python -m snip_megatron.train`): the rule's example as the compact loop's flags, exit status 2 and
the rule's line before anything is built."""

import pytest

from snip_megatron.support.names import CompactNames
from snip_megatron.support.rules import RULES
from tests.support.examples import settings

PRESETS = {"model.num_moe_experts": "llama_tiny_moe", "model.multi_latent_attention": "llama_tiny_mla"}
"""The compact loop's model settings are its presets."""


def compact_argv(example: dict) -> "list[str] | None":
    """The compact loop's flags for `example`, or None where it has no flag for a setting."""
    if not all(CompactNames().reaches(path) for path in example):
        return None
    argv = []
    for path, value in example.items():
        if path in PRESETS:
            argv += ["--model", PRESETS[path]]
        elif path in ("model.tensor_model_parallel_size", "run.world_size"):  # processes: TP x PP here
            argv += ["--tp", str(value)]
        elif path == "run.backend":
            argv += ["--backend", value]
    return argv


CASES = [rule for rule in RULES if "compact" in rule.entries and compact_argv(rule.example) is not None]
# MLA's rules are refused otherwise on megatron-core < 0.17 (model.check_mla_buildable): the compat lane runs them.
PARAMS = [pytest.param(r, id=r.name, marks=[pytest.mark.compat] if r.example.get("model.multi_latent_attention") else [])
          for r in CASES]


@pytest.mark.parametrize("rule", PARAMS)
def test_each_rule_is_refused_through_the_compact_loops_command_line(rule, monkeypatch, capsys):
    from snip_megatron.errors import run_cli
    from snip_megatron.megatron.apply import megatron_core_version
    from snip_megatron.te import installed
    from snip_megatron.train.__main__ import main
    from snip_megatron.train.loop import Trainer

    monkeypatch.setattr(installed, "te_installed", lambda: rule.example.get("run.te_installed", True))
    monkeypatch.setattr(Trainer, "__init__", lambda *a, **k: pytest.fail("the compact loop let this run start"))
    status = run_cli("python -m snip_megatron.train", main, compact_argv(rule.example))
    err = capsys.readouterr().err
    err = err[err.index("python -m snip_megatron.train: error:"):]  # after the start-up lines of a first import
    assert status == 2, err
    if rule.example.get("model.multi_latent_attention") and megatron_core_version() < (0, 17):
        assert "multi-latent attention on megatron-core < 0.17 needs Transformer Engine" in err, err  # compat lane
        return
    s = settings(rule.example, "compact")
    assert err.startswith("python -m snip_megatron.train: error: the compact loop cannot run this"), err
    assert rule.text(s, CompactNames(), rule.holds(s)) in err, err
