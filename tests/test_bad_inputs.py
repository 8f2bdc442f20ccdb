"""Bad input gets one clear line and exit status 2, never a traceback, on every command line:
snip-train (its dry run checks every input file), the compact loop and snip-pretrain-gpt. Each case
names the file or the setting that is wrong. `--debug` shows the traceback instead."""

import json
import os
import subprocess
import sys

import pytest

from snip_megatron.errors import run_cli
from snip_megatron.plan import Plan
from tests.distributed import ROOT

HAVE_TRAINING = True
try:
    import megatron.training.training  # noqa: F401
except Exception:
    HAVE_TRAINING = False

MEGATRON_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
                  "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
                  "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--mock-data", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad input files: a corrupt plan, a plan for another model, a corrupt JSONL corpus, a corrupt
    tokenizer, a checkpoint folder whose SNIP state is corrupt."""
    root = tmp_path_factory.mktemp("bad")
    (root / "corrupt.json").write_text("{\n  \"version\": 1,\n")
    Plan.uniform(3, "fp8").save(root / "three_layers.json")
    Plan.uniform(2, "fp8").save(root / "two_layers.json")
    (root / "corpus.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{broken\n")
    (root / "tokenizer.json").write_text("not a tokenizer")
    ckpt = root / "ckpt"
    (ckpt / "iter_0000002").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    (ckpt / "iter_0000002" / "snip_state.json").write_text("{oops")
    return root


# -- snip-train: in process (composition and file checks only) --------------------------------------

SNIP_TRAIN = [
    (["snip.plan=/missing/plan.json"], "SNIP plan /missing/plan.json: no such file"),
    (["snip.plan={root}/corrupt.json"], "SNIP plan {root}/corrupt.json: plan is not valid JSON"),
    (["snip.plan={root}/three_layers.json"], "SNIP plan {root}/three_layers.json does not fit this model: "
                                            "plan is missing 12 linear(s) of the model"),
    (["data=indexed", "data.path=/missing/tokens", "data.tokenizer={root}/tokenizer.json"],
     "data.path='/missing/tokens': /missing/tokens.bin does not exist"),
    (["data.corpus=/missing/texts"], "data.corpus: corpus '/missing/texts' does not exist"),
    (["data.tokenizer=/missing/tok.json"], "data.tokenizer='/missing/tok.json' does not exist"),
    (["train.load=/missing/ckpt"], "train.load='/missing/ckpt' is not a folder"),
    (["model.num_layers=many"], "cannot compose recipe"),
]


@pytest.mark.parametrize("overrides, message", SNIP_TRAIN)
def test_snip_train_dry_run_refuses_bad_input(files, capsys, overrides, message):
    from snip_megatron.cli.train import main

    args = ["--dry-run", *(o.format(root=files) for o in overrides)]
    assert run_cli("snip-train", main, args) == 2
    err = capsys.readouterr().err
    assert err.startswith("snip-train: error: ") and message.format(root=files) in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_debug_shows_the_traceback(files):
    from snip_megatron.cli.train import main

    with pytest.raises(ValueError, match="no such file"):
        run_cli("snip-train", main, ["--debug", "--dry-run", "snip.plan=/missing/plan.json"])


# -- the compact loop and snip-pretrain-gpt: subprocesses (they start a process group) --------------

def run_module(module: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


COMPACT = [
    (["--snip", "--snip-plan", "/missing/plan.json"], "--snip-plan /missing/plan.json: no such file"),
    (["--snip", "--snip-plan", "{root}/three_layers.json"], "does not fit this model"),
    (["--corpus", "/missing/texts"], "corpus '/missing/texts' does not exist"),
    (["--corpus", "{root}/corpus.jsonl"], "corpus.jsonl:2: not valid JSON"),
    (["--tokenizer", "/missing/tok.json"], "/missing/tok.json does not exist"),
    (["--tokenizer", "{root}/tokenizer.json"], "tokenizer.json could not be loaded"),
    (["--load-dir", "/missing/ckpt"], "no checkpoint to load: folder /missing/ckpt does not exist"),
    (["--lr", "-1"], "TrainConfig.lr=-1.0 must be > 0"),
]


@pytest.mark.launches
@pytest.mark.parametrize("args, message", COMPACT)
def test_the_compact_loop_refuses_bad_input(files, tmp_path, args, message):
    args = [a.format(root=files) for a in args]
    proc = run_module("snip_megatron.train", ["--steps", "2", "--no-progress", "--data-cache",
                                              str(files / "cache"), "--max-bytes", "300000", *args], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "python -m snip_megatron.train: error: " in proc.stderr
    assert message.format(root=files) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


PRETRAIN = [
    (["--snip", "--snip-plan", "/missing/plan.json"], "--snip-plan /missing/plan.json: no such file"),
    (["--snip", "--load", "{root}/ckpt"], "ckpt/iter_0000002/snip_state.json: the SNIP state of this "
                                          "checkpoint cannot be read"),
    (["--snip", "--te-precision-config-file", "/missing/precision.yaml"],
     "--te-precision-config-file /missing/precision.yaml: no such file"),
    (["--snip", "--snip-fp4-budget", "2"], "--snip-fp4-budget must be a fraction in [0, 1]"),
]


@pytest.mark.launches
@pytest.mark.skipif(not HAVE_TRAINING, reason="snip-pretrain-gpt needs megatron.training "
                                              "(megatron-core >= 0.19, prod lane)")
@pytest.mark.parametrize("args, message", PRETRAIN)
def test_snip_pretrain_gpt_refuses_bad_input(files, tmp_path, args, message):
    args = [a.format(root=files) for a in args]
    proc = run_module("snip_megatron.pretrain", [*MEGATRON_MODEL, *args], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "snip-pretrain-gpt: error: " in proc.stderr
    assert message.format(root=files) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
