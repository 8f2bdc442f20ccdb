"""snip-analyze on a checkpoint saved by the compact loop (python -m snip_megatron.train) of its
MoE preset (llama_tiny_moe: layers 1, 3, 5 MoE, the others dense): the table, the plans keyed by
the preset's inventory (its expert units) and their recipes, nothing written into the checkpoint;
a checkpoint of another model is refused in one line naming the flag."""

import subprocess
import sys

import pytest

from snip_megatron.analyze.cli import main
from snip_megatron.errors import run_cli
from snip_megatron.models import gpt
from snip_megatron.plan import Plan
from snip_megatron.shapes import PRESETS
from tests.analyze.helpers import check_analysis, snapshot
from tests.distributed import ROOT

pytestmark = pytest.mark.launches

LOOP = ["--model", "llama_tiny_moe", "--micro-batch-size", "2", "--global-batch-size", "8", "--max-bytes", "300000"]


def test_a_compact_loop_checkpoint_is_analyzed_without_writing_into_it(tmp_path, capsys):
    data = ["--vocab-size", "512", "--data-cache", str(tmp_path / "data")]
    ckpt = tmp_path / "ckpt"
    train = subprocess.run([sys.executable, "-m", "snip_megatron.train", *LOOP, *data, "--steps", "2",
                            "--eval-interval", "0", "--no-progress", "--save-dir", str(ckpt)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    before = snapshot(ckpt)
    budgets = [0.5, 0.75, 1.0]
    out = tmp_path / "analysis"
    assert run_cli("snip-analyze", main, [*LOOP, *data, "--load", str(ckpt), "--out", str(out),
                                          "--budgets", "0.5,0.75,1", "--analyze-microbatches", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"[snip-analyze] {ckpt} at step 2: 2 micro-batches measured" in printed
    doc = check_analysis(out, printed, budgets, linears=24, step=2)
    assert doc["plans"][-1]["stay_high"] == []  # all FP4
    inventory = gpt.inventory(PRESETS["llama_tiny_moe"], moe=gpt.PRESET_MOE["llama_tiny_moe"])
    assert list(Plan.load(out / doc["plans"][0]["files"]["json"])) == list(inventory.keys())  # expert units
    assert snapshot(ckpt) == before

    # Another vocabulary (a tokenizer of 640 tokens): refused by the parameters' shapes, nothing written.
    other = tmp_path / "other"
    code = run_cli("snip-analyze", main, [*LOOP, "--vocab-size", "640", "--data-cache", str(tmp_path / "data"),
                                          "--load", str(ckpt), "--out", str(other)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"snip-analyze: error: --load {ckpt}: the checkpoint holds another "
                                            "model (embedding.word_embeddings.weight is [512, 128] there"), err
    assert "--vocab-size 640" in err[-1] and not other.exists() and snapshot(ckpt) == before
