"""`python -m snip_megatron.train --snip ...`: the compact loop runs the SNIP controller."""

import json
import subprocess
import sys

import pytest

from tests.distributed import ROOT


@pytest.mark.launches
def test_compact_loop_with_snip_replans_and_logs(tmp_path):
    cmd = [sys.executable, "-m", "snip_megatron.train", "--model", "llama_tiny", "--steps", "6",
           "--micro-batch-size", "2", "--eval-interval", "0", "--no-progress", "--max-bytes", "300000",
           "--vocab-size", "512", "--data-cache", str(tmp_path / "data"),
           "--metrics", str(tmp_path / "run" / "metrics.jsonl"), "--tensorboard-dir", str(tmp_path / "tb"),
           "--snip", "--snip-fp4-budget", "0.5", "--snip-warmup", "3", "--snip-interval", "100",
           "--snip-lag", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT first_val_loss=" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "snip_plans.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 4]
    assert set(rows[0]["plan"].values()) == {"fp8"}           # the initial plan
    assert rows[1]["fp4_fraction"] >= 0.5 and rows[1]["solver"] in ("cbc", "exact")
    assert "[snip] step 4: plan" in out.stdout
    check_tensorboard(tmp_path / "tb")


def check_tensorboard(folder):
    """The loop's metrics and SNIP's figures, read back with TensorBoard's event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"images": 0, "tensors": 0, "scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("snip/flops_fp4")] == [0, 4]
    assert events.Scalars("snip/flops_fp4")[1].value >= 0.5
    assert [e.step for e in events.Scalars("snip/predicted_cost")] == [4]
    assert [e.step for e in events.Images("snip/plan_heatmap")] == [0, 4]
    table = events.Tensors("snip/plan_table/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert table.splitlines()[2].startswith("| 1 | linear_qkv | ")


def test_the_compact_loop_takes_the_emulated_formats_and_refuses_te(monkeypatch, capsys):
    """The emulated backend runs the recipes' own variants, FP4 included; the TE backend is refused
    at start-up (support rule compact-te: snip-pretrain-gpt runs TE linears)."""
    from snip_megatron.formats.precision import Formats
    from snip_megatron.te import installed
    from snip_megatron.train.__main__ import parse_args

    train, snip, _ = parse_args(["--snip"])
    assert train.formats == Formats() and snip.precisions == ["fp8", "fp4"]
    monkeypatch.setattr(installed, "te_installed", lambda: True)
    with pytest.raises(ValueError, match=r"--backend te: the compact loop's Transformer Engine path needs a GPU"):
        parse_args(["--backend", "te", "--snip"])
