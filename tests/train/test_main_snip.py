"""`python -m snip_megatron.train --snip ...`: the compact loop runs the SNIP controller."""

import json
import subprocess
import sys

from tests.distributed import ROOT


def test_compact_loop_with_snip_replans_and_logs(tmp_path):
    cmd = [sys.executable, "-m", "snip_megatron.train", "--model", "llama_tiny", "--steps", "6",
           "--micro-batch-size", "2", "--eval-interval", "0", "--no-progress", "--max-bytes", "300000",
           "--vocab-size", "512", "--data-cache", str(tmp_path / "data"),
           "--metrics", str(tmp_path / "run" / "metrics.jsonl"),
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
