"""snip-analyze on a Megatron-Bridge checkpoint (a plain Bridge run of the tiny recipe, 2 steps,
saved): the run's recipe and overrides load it at its step in Bridge's own set-up, one SNIP
measurement, the table and the plans (their static recipes read back by Megatron's parser), and
nothing written into the checkpoint; the same checkpoint without --recipe, or with a recipe of
another model, is refused in one line naming the fix or the field, with nothing written."""

import pytest

from snip_megatron.analyze.cli import main
from snip_megatron.errors import run_cli
from tests.analyze.helpers import check_analysis, snapshot
from tests.bridge.runs import worker

RECIPE = "tests.bridge.tiny:tiny_recipe"


@pytest.fixture(scope="module")
def bridge_checkpoint(tmp_path_factory):
    """Bridge's pretrain() of the tiny recipe without SNIP (2 layers, 2 steps), saved at step 2."""
    root = tmp_path_factory.mktemp("bridge_run")
    worker(root / "train", "--layers", "2", "--iters", "2", "--save", str(root / "ckpt"), "--save-interval", "2",
           "--no-snip")
    return root / "ckpt"


def refused(capsys, argv) -> str:
    assert run_cli("snip-analyze", main, argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("snip-analyze: error: "), lines
    return lines[-1].removeprefix("snip-analyze: error: ")


def test_a_bridge_checkpoint_is_analyzed_without_writing_into_it(bridge_checkpoint, bridge_on_cpu, tmp_path, capsys):
    ckpt, out = bridge_checkpoint, tmp_path / "analysis"
    before = snapshot(ckpt)
    assert refused(capsys, ["--load", str(ckpt), "--out", str(out)]) == (
        f"--load {ckpt}: a Megatron-Bridge checkpoint (run_config.yaml in its iteration folder); give --recipe "
        "MODULE:FUNCTION, the run's recipe, and its overrides")
    assert refused(capsys, ["--recipe", RECIPE, "model.num_layers=3", "--load", str(ckpt), "--out", str(out)]) == (
        f"--load {ckpt}: the checkpoint holds another model (model.num_layers 2 there, 3 here); give the run's "
        "own recipe and overrides")
    assert not out.exists() and snapshot(ckpt) == before

    assert run_cli("snip-analyze", main, ["--recipe", RECIPE, "--load", str(ckpt), "--out", str(out),
                                          "--budgets", "0.5,0.75", "--analyze-microbatches", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"[snip-analyze] {ckpt} at step 2: 2 micro-batches measured" in printed
    check_analysis(out, printed, [0.5, 0.75], linears=8, step=2)
    assert snapshot(ckpt) == before
