"""`python -m snip_megatron.train --snip ...`: the compact loop runs the SNIP controller."""

import json
import subprocess
import sys

from tests.distributed import ROOT


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


def test_te_backend_formats_are_resolved_for_the_gpu_or_refused(monkeypatch, capsys):
    """The compact loop's TE backend takes the formats TE runs on this GPU (its capability patched
    where SNIP reads it), like the Megatron-LM entry; without a GPU it stops at the flags."""
    import pytest

    from snip_megatron.formats.precision import Formats
    from snip_megatron.te import gpu, installed
    from snip_megatron.train.__main__ import parse_args

    for name in ("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--backend", "te", "--snip"])  # this machine has no GPU
    assert "the TE backend needs a CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(gpu, "current_sm", lambda: 90)
    with pytest.raises(SystemExit):
        parse_args(["--backend", "te", "--snip"])  # a GPU, but no Transformer Engine here
    assert "Transformer Engine cannot be imported" in capsys.readouterr().err
    ok = installed.Availability(True)
    monkeypatch.setattr(installed, "read_te_support", lambda: installed.TESupport(
        version="2.14.0", fp8=ok, fp8_block_scaling=ok, mxfp8=ok, nvfp4=ok))
    train, snip, _, te = parse_args(["--backend", "te", "--snip"])
    assert train.formats == snip.formats == Formats(fp8_block_scales="pow2") and te.sm == 90
    assert (snip.precisions, snip.budget, snip.gemm_cost) == (["bf16", "fp8"], "fp8_fraction", "bf16=1,fp8=0.5,fp4=1")
    with pytest.raises(SystemExit):
        parse_args(["--backend", "te", "--snip", "--snip-fp4-recipe", "mxfp4"])
    assert "--snip-fp4-recipe='mxfp4'" in capsys.readouterr().err
    train, snip, _, te = parse_args(["--snip"])  # the emulated backend: the recipes' own variants, FP4
    assert train.formats == Formats() and snip.precisions == ["fp8", "fp4"] and te is None
