"""snip-analyze refuses bad input in one line, exit 2, before loading anything and with nothing
written: no checkpoint, a folder without one, --out inside the checkpoint, budgets out of range
or unparsable (checked against the run's budget kind), a non-positive K."""

import sys

import pytest

from snip_megatron.analyze.cli import main
from snip_megatron.errors import run_cli


@pytest.fixture
def megatron_ckpt(tmp_path):
    """A folder that looks like a Megatron-LM checkpoint of iteration 2 (nothing in it is read)."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000002").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    return ckpt


def refused(capsys, argv) -> str:
    assert run_cli("snip-analyze", main, argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("snip-analyze: error: ") and captured.out == "", captured
    return lines[0].removeprefix("snip-analyze: error: ")


@pytest.mark.parametrize("extra, message", [
    (["--budgets", "0.5,1.5"], "--budgets: 1.5 is not a fraction in [0, 1] (the run's budget is fp4_fraction)"),
    (["--budgets", "0.5,half"], "--budgets '0.5,half': give numbers separated by commas, e.g. 0.5,0.75,0.9"),
    (["--budgets", "-0.1"], "--budgets: -0.1 is not a fraction in [0, 1]"),
    (["--snip-budget", "speedup", "--budgets", "0.9"], "--budgets: 0.9 is not a speed-up >= 1 (the run's budget "
                                                       "is speedup)"),
    (["--snip-fp8-budget", "0.9", "--budgets", "2"], "--budgets: 2 is not a fraction in [0, 1] (the run's budget "
                                                     "is fp8_fraction)"),
    (["--analyze-microbatches", "0"], "--analyze-microbatches 0: give a positive number"),
])
def test_bad_budgets_and_k_are_refused_before_anything_loads(capsys, tmp_path, megatron_ckpt, extra, message):
    out = tmp_path / "out"
    assert refused(capsys, ["--load", str(megatron_ckpt), "--out", str(out), *extra]).startswith(message)
    assert not out.exists()


def test_a_missing_or_empty_checkpoint_and_an_out_inside_it_are_refused(capsys, tmp_path, megatron_ckpt):
    out = tmp_path / "out"
    missing = tmp_path / "nowhere"
    assert refused(capsys, ["--load", str(missing), "--out", str(out)]) == f"--load {missing}: no such checkpoint folder"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refused(capsys, ["--load", str(empty), "--out", str(out)]).startswith(
        f"--load {empty}: no checkpoint there (no latest_checkpointed_iteration.txt")
    assert refused(capsys, ["--load", str(megatron_ckpt), "--ckpt-step", "7", "--out", str(out)]) == (
        f"--load {megatron_ckpt}: no checkpoint of iteration 7 there (iter_0000007 is missing)")
    release = tmp_path / "release"
    (release / "release").mkdir(parents=True)
    (release / "latest_checkpointed_iteration.txt").write_text("release")
    assert refused(capsys, ["--load", str(release), "--out", str(out)]).startswith(
        f"--load {release}: a release checkpoint (converted weights, no training step or data position)")
    inside = megatron_ckpt / "analysis"
    assert "snip-analyze never writes into a checkpoint" in refused(
        capsys, ["--load", str(megatron_ckpt), "--out", str(inside)])
    assert not out.exists() and not inside.exists()
    assert sorted(p.name for p in megatron_ckpt.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_a_bridge_checkpoint_needs_recipe_and_megatron_bridge(capsys, tmp_path, megatron_ckpt):
    """Told apart by Bridge's run_config.yaml: without --recipe, the fix is named; with it, where
    Megatron-Bridge is not installed (this lane), what to install; --recipe with a Megatron-LM
    checkpoint is refused too. Nothing is written."""
    out, bridge_ckpt = tmp_path / "out", tmp_path / "bridge"
    (bridge_ckpt / "iter_0000002").mkdir(parents=True)
    (bridge_ckpt / "iter_0000002" / "run_config.yaml").write_text("model:\n  num_layers: 2\n")
    (bridge_ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    assert refused(capsys, ["--load", str(bridge_ckpt), "--out", str(out)]).endswith(
        "a Megatron-Bridge checkpoint (run_config.yaml in its iteration folder); give --recipe "
        "MODULE:FUNCTION, the run's recipe, and its overrides")
    recipe = ["--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config"]
    assert refused(capsys, [*recipe, "--load", str(bridge_ckpt), "--out", str(out)]) == (
        "Megatron-Bridge is not installed here: pip install megatron-bridge (0.6.2 tested)")
    assert refused(capsys, [*recipe, "--load", str(megatron_ckpt), "--out", str(out)]).endswith(
        f"--load {megatron_ckpt} is not a Megatron-Bridge checkpoint (no run_config.yaml); drop --recipe and "
        "give the run's own flags")
    assert not out.exists() and "megatron.bridge" not in sys.modules


def test_a_hybrid_checkpoint_saved_at_another_pipeline_layout_is_the_same_model():
    """The '|' cuts of --hybrid-layer-pattern place layers on pipeline stages; the layers are the model."""
    from types import SimpleNamespace

    from snip_megatron.analyze.megatron_lm import _model_value

    def pattern(p):
        return _model_value(SimpleNamespace(hybrid_layer_pattern=p), "hybrid_layer_pattern")

    assert pattern("*-|*-|*-|*-") == pattern("*-*-|*-*-") == pattern("*-*-*-*-")
    assert pattern("*-|*-") != pattern("*E|*-")
