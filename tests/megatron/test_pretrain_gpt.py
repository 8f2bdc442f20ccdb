"""snip-pretrain-gpt: the plan's precedence, snip_state.json, the step seam a controller joins at,
and real CPU runs of megatron.training.pretrain (prod lane): SNIP measures and re-plans, the plan
goes into the checkpoint and a resumed run keeps it; real text over TP=2 with a pinned plan."""

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from snip_megatron.config import SnipConfig
from snip_megatron.megatron import pretrain_gpt as pg
from snip_megatron.plan import Plan
from tests.distributed import ROOT, run_distributed

HAVE_TRAINING = True
try:
    import megatron.training.training  # noqa: F401
except Exception:
    HAVE_TRAINING = False
needs_training = pytest.mark.skipif(
    not HAVE_TRAINING, reason="megatron.training ships only with megatron-core >= 0.19 (prod lane); "
                              "the compat lane checks the clear refusal instead")

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
         "--max-position-embeddings", "32", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
         "--lr-decay-style", "cosine", "--tokenizer-type", "NullTokenizer", "--log-interval", "1",
         "--eval-iters", "1"]


# -- pieces, both lanes ----------------------------------------------------------------------------


def test_refuses_clearly_without_megatron_training(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.training", None)  # import fails as on megatron-core 0.16
    with pytest.raises(SystemExit, match=r"needs megatron.training \(shipped with megatron-core >= 0.19\)"):
        pg.require_megatron_training()


@pytest.mark.skipif(HAVE_TRAINING, reason="this lane has megatron.training: the real runs below cover it")
def test_command_fails_with_the_reason_in_the_compat_lane():
    proc = subprocess.run([sys.executable, "-m", "snip_megatron.megatron.pretrain_gpt", "--snip"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "snip-pretrain-gpt needs megatron.training" in proc.stderr and "0.16" in proc.stderr


def test_plan_precedence(tmp_path):
    saved = Plan.uniform(2, "fp8").replace({"1.linear_fc1": "fp4"})
    saved.save(tmp_path / "plan.json")
    resumed = {"plan": Plan.uniform(2, "bf16").to_dict()}
    cfg = SnipConfig(enabled=True, initial_precision="fp4")
    assert pg.initial_plan(SnipConfig(), 2, resumed) == (None, "off")
    assert pg.initial_plan(cfg, 2, None) == (Plan.uniform(2, "fp4"), "initial fp4")
    plan_cfg = SnipConfig(enabled=True, plan=str(tmp_path / "plan.json"))
    assert pg.initial_plan(plan_cfg, 2, None)[0] == saved
    assert pg.initial_plan(plan_cfg, 2, resumed) == (Plan.uniform(2, "bf16"), "checkpoint")
    pinned = SnipConfig(enabled=True, plan=str(tmp_path / "plan.json"), pin_plan=True)
    assert pg.initial_plan(pinned, 2, resumed)[0] == saved  # a pinned plan beats the checkpoint
    with pytest.raises(ValueError, match="plan is missing"):
        pg.initial_plan(plan_cfg, 3, None)  # a plan for another model is refused


def test_state_file_round_trip(tmp_path):
    run = pg.SnipRun(config=SnipConfig(enabled=True), num_layers=2, plan=Plan.uniform(2, "fp8"),
                     plan_source="initial fp8")
    path, state = pg.write_state(str(tmp_path), 7, run)
    assert path == tmp_path / "iter_0000007" / pg.STATE_FILE
    assert pg.read_state(str(tmp_path)) is None  # no tracker file: nothing to resume
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    loaded = pg.read_state(str(tmp_path))
    assert loaded == json.loads(json.dumps(state))
    assert Plan.from_dict(loaded["plan"]) == Plan.uniform(2, "fp8")
    assert loaded["snip_config"]["enabled"] is True and loaded["iteration"] == 7
    path.write_text(json.dumps({**state, "version": 99}))
    with pytest.raises(ValueError, match="unknown snip state version 99"):
        pg.read_state(str(tmp_path))


def test_pipeline_stages_follow_megatrons_split():
    stages = pg.pipeline_stages(8, 2, None)
    assert {k.layer: s for k, s in stages.items()} == {1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1, 7: 1, 8: 1}
    interleaved = pg.pipeline_stages(8, 2, 2)  # chunks of 2 layers: stage 0, 1, 0, 1
    assert [interleaved[(layer, "linear_qkv")] for layer in range(1, 9)] == [0, 0, 1, 1, 0, 0, 1, 1]


class Recorder:
    """A controller that records the calls it gets and reads the step's batch on step 2."""

    def __init__(self):
        self.calls, self.plan = [], None

    def attach(self, chunks, step=0):
        self.calls.append(("attach", step))

    def on_step_start(self, trainer, step):
        self.calls.append(("start", step))
        if step == 2:
            self.seen = trainer.current_batch

    def on_step_end(self, trainer, step, metrics):
        self.calls.append(("end", step, metrics["loss"]))

    def state_dict(self):
        return {"calls": len(self.calls)}

    def load_state_dict(self, state):
        self.calls.append(("load", state))


def test_step_seam_replays_the_measured_batches():
    from megatron.core.rerun_state_machine import RerunDataIterator

    rec = Recorder()
    run = pg.SnipRun(config=SnipConfig(enabled=True), num_layers=2, controller=rec, backend="local",
                     controller_state={"calls": 3}, seq_length=32, micro_batch_size=2)
    data = RerunDataIterator(iter(range(100)))
    it = run.step_begin(1, ["chunk"], None, data, num_microbatches=2)
    assert it is data  # nobody read ahead: train_step reads the original iterator
    assert [next(it), next(it)] == [0, 1]
    run.step_end(1, 2.5)
    it = run.step_begin(2, ["chunk"], None, data, num_microbatches=2)
    assert rec.seen == [2, 3]  # the controller saw this step's micro-batches...
    assert isinstance(it, RerunDataIterator) and [next(it), next(it)] == [2, 3]  # ...and trains on them
    assert next(data) == 4  # the data position did not move
    run.step_end(2, None)
    assert rec.calls == [("attach", 0), ("load", {"calls": 3}), ("start", 1), ("end", 1, 2.5),
                         ("start", 2), ("end", 2, None)]
    assert run.state_dict(2)["controller"] == {"calls": 6}


def test_no_controller_no_interference():
    run = pg.SnipRun(config=SnipConfig(enabled=True, plan="p.json", pin_plan=True), num_layers=2, backend="local")
    data = iter([1, 2])
    assert run.step_begin(1, [], None, data, num_microbatches=2) is data


# -- real runs of megatron.training.pretrain on CPU (prod lane) -------------------------------------


def train(tmp_path: Path, *argv: str, nproc: int = 1, timeout: float = 420) -> str:
    args = ["-m", "snip_megatron.megatron.pretrain_gpt", *MODEL, *argv]
    if nproc > 1:
        return run_distributed(args, nproc=nproc, timeout=timeout).stdout
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc.stdout


def snip_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("[snip]")]


def losses(out: str) -> list[float]:
    return [float(line.split("lm loss:")[1].split("|")[0]) for line in out.splitlines()
            if " iteration " in line and "lm loss:" in line]


@needs_training
def test_snip_measures_replans_checkpoints_and_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    snip = ["--snip", "--snip-warmup", "2", "--snip-interval", "10", "--snip-lag", "1", "--snip-fp4-budget", "0.5"]
    common = ["--mock-data", "--vocab-size", "256", "--train-iters", "6", "--eval-interval", "100",
              "--save", ckpt, "--load", ckpt, "--save-interval", "4", *snip]
    out = train(tmp_path, *common, "--exit-interval", "4")
    lines = snip_lines(out)
    assert "[snip] on; backend emulated; plan: initial fp8 {'bf16': 0, 'fp8': 8, 'fp4': 0}" in lines
    assert any(line.startswith("[snip] rank 0 runs the plan on its 8 planned linears") for line in lines)
    updates = [line for line in lines if line.startswith("[snip] step 3: plan")]
    assert updates, lines
    fp4 = float(re.search(r"FP4 ([0-9.]+)% of linear FLOPs", updates[0]).group(1))
    assert fp4 >= 50.0, updates  # the budget: at least half of the linear FLOPs in FP4
    assert len(losses(out)) == 4 and all(2.0 < x < 7.0 for x in losses(out))
    state = json.loads((tmp_path / "ckpt" / "iter_0000004" / pg.STATE_FILE).read_text())
    plan = Plan.from_dict(state["plan"])
    assert state["plan_source"] == "controller" and plan.counts()["fp4"] > 0
    assert state["controller"]["plan"] == state["plan"] and state["controller"]["history"]

    # Resume: the model is built with the saved plan, whatever --snip-initial-precision says.
    out = train(tmp_path, *common, "--snip-initial-precision", "fp4")
    lines = snip_lines(out)
    assert f"[snip] on; backend emulated; plan: checkpoint {plan.counts()}" in lines, lines
    assert f"[snip] rank 0 runs the plan on its 8 planned linears: {plan.counts()}" in lines
    assert len(losses(out)) == 2  # iterations 5 and 6 only
    final = json.loads((tmp_path / "ckpt" / "iter_0000006" / pg.STATE_FILE).read_text())
    assert final["iteration"] == 6 and Plan.from_dict(final["plan"]).counts() == plan.counts()


@needs_training
def test_real_text_tp2_pinned_plan(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "each linear layer runs in the lowest precision it tolerates and is planned again".split()
    for i in range(40):  # a small real-text corpus: tokenizer training and indexing take seconds
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(300)))
    pinned = Plan.uniform(2, "fp4").replace({"1.linear_qkv": "fp8", "2.linear_fc2": "bf16"})
    pinned.save(tmp_path / "pin.json")
    out = train(tmp_path, "--tensor-model-parallel-size", "2", "--corpus", str(corpus / "*.txt"),
                "--corpus-cache", str(tmp_path / "cache"), "--vocab-size", "300", "--split", "90,10,0",
                "--train-iters", "3", "--eval-interval", "3", "--save", str(tmp_path / "ckpt"),
                "--save-interval", "3", "--snip", "--snip-plan", str(tmp_path / "pin.json"), "--snip-pin-plan",
                nproc=2)
    assert f"[snip] rank 0 runs the plan on its 8 planned linears: {pinned.counts()}" in out
    assert "validation loss at iteration 3" in out and len(losses(out)) == 3
    state = json.loads((tmp_path / "ckpt" / "iter_0000003" / pg.STATE_FILE).read_text())
    assert Plan.from_dict(state["plan"]) == pinned and state["plan_source"].startswith("pinned")


# The main block of Megatron-LM's pretrain_gpt.py (core_v0.19.0) with the patch's two SNIP lines,
# on CPU: Megatron builds the model from `model_cfg` itself, SNIP applies the plan at step 1.
PATCHED_MAIN = """
import sys
from snip_megatron.megatron import add_snip_args
from snip_megatron.megatron import pretrain_gpt as pg
from snip_megatron.megatron.pretrain_gpt import setup_megatron_lm


# Megatron-LM's own main guard: its checkpoint writer spawns processes that re-import __main__.
if __name__ == "__main__":
    sys.argv = [sys.argv[0]] + pg.CPU_FLAGS + pg._ckpt_format_flags() + sys.argv[1:]
    pg.patch_arguments_for_cpu()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=lambda parser: add_snip_args(parser),
                                   args_defaults={"tokenizer_type": "NullTokenizer"})
    pg.prepare_cpu(args)  # CPU only; Megatron-LM does this itself on GPUs
    model_cfg = gpt_config_from_args(args)
    setup_megatron_lm(args, model_cfg)
    pg.skip_prebuilt_helpers()
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, pg.datasets_provider, ModelType.encoder_or_decoder, pg.forward_step)
"""


@needs_training
def test_patched_megatron_lm_main_applies_the_plan(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(PATCHED_MAIN)
    plan = Plan.uniform(2, "fp8").replace({"1.linear_fc1": "fp4", "2.linear_qkv": "bf16"})
    plan.save(tmp_path / "plan.json")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script), *MODEL, "--mock-data", "--vocab-size", "256",
                           "--train-iters", "2", "--eval-interval", "100", "--save", str(tmp_path / "ckpt"),
                           "--save-interval", "2", "--snip", "--snip-plan", str(tmp_path / "plan.json"),
                           "--snip-pin-plan"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert f"[snip] rank 0 runs the plan on its 8 planned linears: {plan.counts()}" in proc.stdout
    assert len(losses(proc.stdout)) == 2
    state = json.loads((tmp_path / "ckpt" / "iter_0000002" / pg.STATE_FILE).read_text())
    assert Plan.from_dict(state["plan"]) == plan


@needs_training
def test_bad_snip_flags_fail_before_megatron_starts(capsys):
    code = pg.main([*MODEL, "--mock-data", "--snip", "--snip-lag", "50", "--snip-interval", "10"])
    assert code == 2
    assert "--snip-lag=50 must be smaller than --snip-interval=10" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # a bad value: argparse's own exit 2 and usage line
        pg.main(["--snip-fp4-budget", "2"])
    assert exc.value.code == 2 and "--snip-fp4-budget" in capsys.readouterr().err


# -- patches/megatron-lm-pretrain_gpt.patch: well formed, and every plugin name it calls exists ------

PATCH = ROOT / "patches" / "megatron-lm-pretrain_gpt.patch"


def hunks(text: str) -> list[tuple[str, list[str]]]:
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("@@"):
            current = (line, [])
            out.append(current)
        elif current is not None:
            current[1].append(line)
    return out


def added(text: str) -> str:
    return "\n".join(line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))


def test_patch_is_a_unified_diff_of_pretrain_gpt():
    text = PATCH.read_text()
    assert text.startswith("--- a/pretrain_gpt.py\n+++ b/pretrain_gpt.py\n")
    found = hunks(text)
    assert len(found) == 3
    for header, body in found:  # every hunk's line counts match its header
        old_start, old_len, new_start, new_len = map(int, re.match(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@", header).groups())
        assert sum(1 for b in body if b[:1] in (" ", "-")) == old_len, header
        assert sum(1 for b in body if b[:1] in (" ", "+")) == new_len, header


def test_every_plugin_name_the_patch_uses_exists():
    code = added(PATCH.read_text())
    imports = [n for n in ast.walk(ast.parse(_imports(code)))
               if isinstance(n, ast.ImportFrom)]
    names = {}
    for node in imports:
        module = __import__(node.module, fromlist=[a.name for a in node.names])
        for alias in node.names:
            assert hasattr(module, alias.name), f"{node.module}.{alias.name} does not exist"
            names[alias.asname or alias.name] = getattr(module, alias.name)
    assert set(names) == {"add_snip_args", "setup_megatron_lm"}
    # Each plugin call in the patch matches the plugin's signature.
    assert "add_snip_args(" in code and "setup_megatron_lm(args, model_cfg)" in code
    inspect.signature(names["add_snip_args"]).bind(object())
    inspect.signature(names["setup_megatron_lm"]).bind(object(), object())


def _imports(code: str) -> str:
    return "\n".join(line for line in code.splitlines() if line.startswith("from snip_megatron"))


def test_patch_only_touches_what_it_says():
    text = PATCH.read_text()
    removed = [line for line in text.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert removed == ["-        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,"]


def test_setup_megatron_lm_does_nothing_without_snip():
    pytest.importorskip("megatron.training.arguments",
                        reason="megatron.training ships only with megatron-core >= 0.19 (prod lane)")
    import argparse

    from snip_megatron.megatron import add_snip_args
    from snip_megatron.megatron.pretrain_gpt import setup_megatron_lm

    args = add_snip_args(argparse.ArgumentParser()).parse_args([])
    model_cfg = argparse.Namespace(transformer_layer_spec=None)
    assert setup_megatron_lm(args, model_cfg) is None
    assert model_cfg.transformer_layer_spec is None
    bad = add_snip_args(argparse.ArgumentParser()).parse_args(["--snip", "--snip-pin-plan"])
    with pytest.raises(SystemExit, match="SNIP: bad SNIP flags: --snip-pin-plan is set but --snip-plan is empty"):
        setup_megatron_lm(bad, model_cfg)


def test_buffering_with_virtual_pipeline_chunks():
    # Rank of the last stage under VPP: chunk 0 reads no data (None), chunk 1 does.
    replay, batches = pg._buffer_step([None, iter(["a", "b", "c"])], 2)
    assert batches == ["a", "b"]
    assert replay[0] is None and [next(replay[1]), next(replay[1])] == ["a", "b"]
    _, nothing = pg._buffer_step([None, None], 2)  # a middle stage reads nothing
    assert nothing == [None, None]
