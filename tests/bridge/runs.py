"""Running tests/bridge/bridge_worker.py from tests: one process, torchrun, or a chain of launches
through tests/bridge/launch.py (one import, ranks forked), and its results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.distributed import ROOT, run_distributed

WORKER = str(Path(__file__).with_name("bridge_worker.py"))
LAUNCHER = str(Path(__file__).with_name("launch.py"))


def worker(out: Path, *args: str, nproc: int = 1, snip: "dict | None" = None, check: bool = True,
           timeout: float = 900, env: "dict | None" = None) -> dict:
    """Run the worker (with `env` added to its environment); returns {rank: its JSON} (empty for a
    run that ended without writing)."""
    argv = [WORKER, "--out", str(out), *args] + (["--snip", json.dumps(snip)] if snip is not None else [])
    if nproc > 1:
        proc = run_distributed(argv, nproc=nproc, timeout=timeout, check=check, env=env)
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
    return {"ranks": results(out), "returncode": proc.returncode, "stdout": proc.stdout}


def losses(result: dict) -> dict[int, float]:
    """The losses of the last pipeline stage (the rank that reports them), by step."""
    found = [r["losses"] for r in result["ranks"].values() if r["losses"]]
    return {int(k): v for k, v in found[0].items()} if found else {}


def results(out: Path) -> dict:
    """{rank: its JSON} of a worker run that wrote into `out`."""
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))}


def launch(root: Path, launches: list[dict], *, env: dict, timeout: float = 1800) -> str:
    """Run `launches` ({"nproc", "argv", "env"}: worker arguments, each rank's extra environment) one
    after another through launch.py, in a process with `env` added to its environment; rank r of
    launch i logs to root/log<i>/rank<r>.log. Returns the first rank's log of each launch, joined."""
    root.mkdir(parents=True, exist_ok=True)
    for i, item in enumerate(launches):
        item["logs"] = str(root / f"log{i}")
    (root / "launches.json").write_text(json.dumps(launches))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env}
    proc = subprocess.run([sys.executable, LAUNCHER, str(root / "launches.json")], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    return "\n".join((root / f"log{i}" / "rank0.log").read_text() for i in range(len(launches)))
