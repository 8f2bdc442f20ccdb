"""snip-bridge-pretrain: Bridge's recipe and override syntax; snip.* validated by SnipConfig after
the overrides (a bad value exits 2 naming the field, no traceback); a short run trains with SNIP."""

import json

import pytest

from snip_megatron.bridge import cli

RECIPE = "tests.bridge.tiny:tiny_recipe"


@pytest.mark.parametrize("argv, message", [
    (["snip.fp4_budget=1.5"], r"SnipConfig.fp4_budget must be a fraction in \[0, 1\], got 1.5"),
    (["snip.interval=5"], "SnipConfig.lag=10 must be smaller than SnipConfig.interval=5"),
    (["snip.precisions=[fp8]"], r"SnipConfig.precisions=\['fp8'\] leaves the planner no choice"),
    (["snip.precisions=[bf16,fp8]", "snip.budget=fp4_fraction"], r"SnipConfig.precisions=\['bf16', 'fp8'\] must "
                                                                  r"include fp4"),
    (["snip.fp4_budgt=0.5"], "snip overrides: OverridesError: .*snip.fp4_budgt"),
    (["train.train_itres=3"], "Bridge overrides: OverridesError: .*train.train_itres"),
    (["snip.fp4_budget"], "overrides are KEY=VALUE, got 'snip.fp4_budget'"),
    (["model.fp8=hybrid"], "model.fp8='hybrid': one global FP8 autocast fights SNIP's per-layer plan"),
])
def test_a_bad_setting_exits_2_naming_it(capsys, argv, message):
    import re

    assert cli.main(["--recipe", RECIPE, *argv]) == 2
    err = capsys.readouterr().err
    notices, error = err.split("snip-bridge-pretrain: error: ", 1)  # SNIP's start-up notices (once), the error
    assert all(line.startswith("[snip] ") for line in notices.splitlines()) and re.search(message, error), err
    assert "Traceback" not in err


def test_a_recipe_that_is_not_there_is_named(capsys):
    assert cli.main(["--recipe", "tests.bridge.tiny:no_such_recipe"]) == 2
    assert "tests.bridge.tiny has no no_such_recipe" in capsys.readouterr().err


def test_overrides_and_a_config_file_reach_bridge_and_snip(tmp_path):
    (tmp_path / "run.yaml").write_text("train:\n  train_iters: 7\nsnip:\n  interval: 30\n  fp4_budget: 0.6\n")
    cfg, snip, forward_step = cli.configure(["--recipe", RECIPE, "--config-file", str(tmp_path / "run.yaml"),
                                             "snip.fp4_budget=0.8", "snip.precisions=[bf16,fp8,fp4]",
                                             "optimizer.lr=0.002"])
    assert cfg.train.train_iters == 7 and cfg.optimizer.lr == 0.002
    assert (snip.enabled, snip.interval, snip.fp4_budget, snip.precisions) == (True, 30, 0.8, ["bf16", "fp8", "fp4"])
    from megatron.bridge.training.gpt_step import forward_step as bridge_forward_step

    assert forward_step is bridge_forward_step
    _, off, _ = cli.configure(["--recipe", RECIPE, "snip.enabled=false"])
    assert off.enabled is False


def test_the_command_trains_the_recipe_with_snip(bridge_on_cpu, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert cli.main(["--recipe", RECIPE, "snip.warmup=2", "snip.interval=10", "snip.lag=1", "snip.fp4_budget=0.5",
                     "train.train_iters=3", f"checkpoint.save={ckpt}", "checkpoint.save_interval=3"]) == 0
    out = capsys.readouterr().out
    assert "[snip] on; backend emulated; formats fp8=blockwise fp4=nvfp4; plan: initial fp8" in out
    assert "[snip] step 3: plan" in out
    state = json.loads((ckpt / "iter_0000003" / "snip_state.json").read_text())
    assert state["snip_config"]["fp4_budget"] == 0.5 and state["iteration"] == 3


def test_without_transformer_engine_one_line_names_what_to_install(tmp_path):
    """Megatron-Bridge imports TE unguarded: on a machine without it (this lane, outside the test
    stand-in) the CLI says so in one line and exits 2, before importing Bridge."""
    import os
    import subprocess
    import sys

    from tests.distributed import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "snip_megatron.bridge", "--recipe",
                           "megatron.bridge.recipes.llama.llama3:llama32_1b_pretrain_config", "train.train_iters=4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if "snip-bridge-pretrain" in line]
    assert ours == [f"snip-bridge-pretrain: error: {cli.TE_MISSING}"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert "pip install --no-build-isolation transformer_engine[pytorch]" in cli.TE_MISSING
    helped = subprocess.run([sys.executable, "-m", "snip_megatron.bridge", "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: snip-bridge-pretrain")  # needs no TE


def test_a_missing_bridge_is_named(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "megatron.bridge" else real(name, *a))
    assert cli.main(["--recipe", RECIPE]) == 2
    assert capsys.readouterr().err == ("snip-bridge-pretrain: error: Megatron-Bridge is not installed here: "
                                       "pip install megatron-bridge (0.6.2 tested)\n")
