"""Running tests/bridge/bridge_worker.py from tests: one process or torchrun, and its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.distributed import ROOT, run_distributed

WORKER = str(Path(__file__).with_name("bridge_worker.py"))


def worker(out: Path, *args: str, nproc: int = 1, snip: "dict | None" = None, check: bool = True,
           timeout: float = 900) -> dict:
    """Run the worker; returns {rank: its JSON} (empty for a run that ended without writing)."""
    argv = [WORKER, "--out", str(out), *args] + (["--snip", json.dumps(snip)] if snip is not None else [])
    if nproc > 1:
        proc = run_distributed(argv, nproc=nproc, timeout=timeout, check=check)
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))}
    return {"ranks": results, "returncode": proc.returncode, "stdout": proc.stdout}


def losses(result: dict) -> dict[int, float]:
    """The losses of the last pipeline stage (the rank that reports them), by step."""
    found = [r["losses"] for r in result["ranks"].values() if r["losses"]]
    return {int(k): v for k, v in found[0].items()} if found else {}
