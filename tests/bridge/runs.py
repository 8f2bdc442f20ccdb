"""Running tests/bridge/bridge_worker.py from tests: one process or torchrun, and its results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.distributed import ROOT, run_distributed

WORKER = str(Path(__file__).with_name("bridge_worker.py"))


def worker(out: Path, *args: str, nproc: int = 1, snip: "dict | None" = None, check: bool = True,
           timeout: float = 900, env: "dict | None" = None) -> dict:
    """Run the worker (one process: with `env` added to its environment); returns {rank: its JSON}
    (empty for a run that ended without writing)."""
    argv = [WORKER, "--out", str(out), *args] + (["--snip", json.dumps(snip)] if snip is not None else [])
    if nproc > 1:
        proc = run_distributed(argv, nproc=nproc, timeout=timeout, check=check)
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
        # Output to files and a session of its own: a killed run leaves Bridge's checkpoint writer
        # process behind, which would hold a pipe open; the session's leftovers are killed after.
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / "stdout.txt", "w+") as so, open(Path(out) / "stderr.txt", "w+") as se:
            child = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=so, stderr=se,
                                     start_new_session=True)
            try:
                child.wait(timeout=timeout)
            finally:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            so.seek(0), se.seek(0)
            proc = subprocess.CompletedProcess(child.args, child.returncode, so.read(), se.read())
        if check and proc.returncode != 0:
            raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))}
    return {"ranks": results, "returncode": proc.returncode, "stdout": proc.stdout}


def losses(result: dict) -> dict[int, float]:
    """The losses of the last pipeline stage (the rank that reports them), by step."""
    found = [r["losses"] for r in result["ranks"].values() if r["losses"]]
    return {int(k): v for k, v in found[0].items()} if found else {}
