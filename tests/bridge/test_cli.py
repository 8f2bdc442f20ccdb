"""snip-bridge-pretrain: Bridge's recipe and override syntax; snip.* validated by SnipConfig after
the overrides (a bad value exits 2 naming the field, no traceback); a short run trains with SNIP."""

import json
from pathlib import Path

import pytest

from snip_megatron.bridge import cli
from snip_megatron.plan import Plan

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


CLI_WORKER = str(Path(__file__).with_name("cli_worker.py"))
SCHEDULE = ["snip.warmup=2", "snip.interval=3", "snip.lag=1"]
"""Measure at step 2, plan at 3; resumed at step 3: measure at 5, plan at 6."""


def cli_launch(root: Path, recipe: str, *overrides: str, resume: bool, sm: "int | None" = None) -> dict:
    """Two processes of the command (tests/bridge/cli_worker.py) training `recipe` for three steps
    after the checkpoint (resumed: its weights and SNIP's plan), saved to root/ckpt."""
    steps = 6 if resume else 3
    budget = "snip.fp8_budget=0.5" if sm == 90 else "snip.fp4_budget=0.5"
    argv = ["--recipe", f"tests.bridge.tiny:{recipe}", *SCHEDULE, budget, f"train.train_iters={steps}",
            f"checkpoint.save={root / 'ckpt'}", "checkpoint.save_interval=3", *overrides,
            *([f"checkpoint.load={root / 'ckpt'}", "checkpoint.load_optim=false", "checkpoint.load_rng=false"]
              if resume else [])]
    return {"nproc": 2, "argv": argv, "target": CLI_WORKER,
            "env": {"TE_DOUBLE_COMPUTE_CAPABILITY": f"{sm // 10}.{sm % 10}"} if sm else {}}


def check_cli_run(log: str, root: Path, step: int, resumed: "Plan | None") -> Plan:
    """The launch re-planned at `step` (from the checkpoint's plan when resumed) and saved SNIP's
    state there; returns the saved plan."""
    from tests.pretrain.test_runs import state_of

    lines = log.splitlines()
    source = f"plan: checkpoint {resumed.counts()}" if resumed else "plan: initial fp8"
    assert source in lines[0], lines[0]  # the rest of the launch's "[snip] on; ..." line
    assert any(line.startswith(f"[snip] step {step}: plan") for line in lines), lines
    state = state_of(root / "ckpt", step)
    assert state["iteration"] == step
    return Plan.from_dict(state["plan"])


@pytest.mark.launches
def test_moe_recipes_at_ep2_resumed_at_pp2_through_the_command(tmp_path):
    """The command (two processes) on the tiny Qwen3-MoE recipe (SNIP's emulated linears) and on the
    tiny DeepSeek-style one on TE's grouped experts (over the TE double, SM90 then SM100): EP=2,
    saved, resumed at PP=2 from its weights and plan (not the optimizer: at EP > 1 the experts have
    an optimizer of their own). Each launch measures and re-plans; the layouts are Bridge overrides."""
    from tests.bridge.runs import launch
    from tests.te.te_versions import double_pythonpath

    qwen, deepseek = tmp_path / "qwen3_moe", tmp_path / "deepseek"
    ep, pp = "model.expert_model_parallel_size=2", "model.pipeline_model_parallel_size=2"
    logs = [launch(qwen, [cli_launch(qwen, "tiny_qwen3_moe_recipe", ep, resume=False),
                          cli_launch(qwen, "tiny_qwen3_moe_recipe", pp, resume=True)], env={}),
            launch(deepseek, [cli_launch(deepseek, "tiny_deepseek_te_recipe", ep, resume=False, sm=90),
                              cli_launch(deepseek, "tiny_deepseek_te_recipe", pp, resume=True, sm=100)],
                   env={"PYTHONPATH": double_pythonpath(apex=True)})]
    for root, log in zip((qwen, deepseek), logs):
        first, second = log.split("[snip] on;")[1:]  # each launch's rank-0 log
        saved = check_cli_run(first, root, 3, None)
        replanned = check_cli_run(second, root, 6, saved)
        plan, replanned = ({str(k): p.value for k, p in q.items()} for q in (saved, replanned))
        assert {f"{layer}.expert_fc{j}" for layer in (1, 2) for j in (1, 2)} <= set(plan), plan
        if root == deepseek:  # SM90 then SM100: BF16/FP8, then FP8/FP4 with the MTP layer out of FP4
            assert "fp4" not in plan.values() and "fp4" in replanned.values(), (plan, replanned)
            assert any(k.startswith("1.mtp.") for k in replanned), replanned
            assert all(p != "fp4" for k, p in replanned.items() if ".mtp." in k), replanned
