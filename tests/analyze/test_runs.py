"""snip-analyze on a checkpoint saved by snip-pretrain-gpt at TP=2 (a plain BF16 run), analyzed
at TP=2 in Megatron-LM's loop: the table, the plans and their recipes, nothing written into the
checkpoint; the same checkpoint analyzed at PP=2 (two stages measure, stage 0 plans); a
checkpoint of another model is refused before Megatron starts, naming the flag."""

import json
import os

import pytest

from snip_megatron.plan import Plan
from tests.analyze.helpers import check_analysis, snapshot, table_rows
from tests.distributed import ROOT, run_python
from tests.forked import MEGATRON_LM
from tests.pretrain.test_runs import ENV, MODEL, needs_training, run

pytestmark = pytest.mark.launches

DATA = ["--mock-data", "--vocab-size", "256", "--train-iters", "2", "--eval-interval", "100"]


@needs_training
def test_a_tp2_megatron_lm_checkpoint_is_analyzed_without_writing_into_it(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "analysis"
    tp2 = ["--tensor-model-parallel-size", "2"]
    run(tmp_path, ["-m", "snip_megatron.pretrain"], *tp2, *DATA, "--save", str(ckpt), "--save-interval", "2",
        nproc=2)
    before = snapshot(ckpt)
    printed = run(tmp_path, ["-m", "snip_megatron.analyze"], *tp2, *DATA, "--load", str(ckpt), "--out", str(out),
                  "--budgets", "0.5,0.75", "--analyze-microbatches", "2", nproc=2)
    assert f"[snip-analyze] {ckpt} at step 2: 2 micro-batches measured" in printed
    check_analysis(out, printed, [0.5, 0.75], linears=8, step=2)
    assert snapshot(ckpt) == before

    # PP=2: each stage measures its layer, the first stage gathers the table and plans all 8 linears.
    printed = run(tmp_path, ["-m", "snip_megatron.analyze"], "--pipeline-model-parallel-size", "2", *DATA,
                  "--load", str(ckpt), "--out", str(tmp_path / "pp2"), "--budgets", "0.5,0.75",
                  "--analyze-microbatches", "2", nproc=2)
    rows = table_rows(printed, [0.5, 0.75])
    solved = {p["budget"]: p for p in json.loads((tmp_path / "pp2" / "analysis.json").read_text())["plans"]}
    for budget, row in rows.items():
        plan = Plan.load(tmp_path / "pp2" / f"plan_fp4_{budget:g}.json")
        assert len(plan) == 8 and solved[budget]["fp4_fraction"] >= budget
        assert int(row[8].rstrip(":")) == 8 - plan.counts()["fp4"] == len(solved[budget]["stay_high"])
    assert snapshot(ckpt) == before

    # Another model (3 layers): refused from the checkpoint's own arguments, before Megatron starts.
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    model = [a if a != "2" or MODEL[i - 1] != "--num-layers" else "3" for i, a in enumerate(MODEL)]
    proc = run_python(["-m", "snip_megatron.analyze", *model, *DATA, "--load", ckpt, "--out", tmp_path / "other"],
                      cwd=tmp_path, env=env, timeout=300, check=False, preload=MEGATRON_LM)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"snip-analyze: error: --load {ckpt}: the checkpoint holds another model (--num-layers 2 there, 3 here); "
        "give the run's own model flags")
    assert not (tmp_path / "other").exists() and snapshot(ckpt) == before
