"""Run a module or script under N local processes (torchrun's environment, gloo) with a free port and a
timeout, or as one plain process: forked from a process that imported torch and Megatron once
(tests/forked.py), or, with SNIP_TEST_FORK=0, under torchrun or python itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.forked import MEGATRON_CORE, free_port, launch

ROOT = Path(__file__).resolve().parent.parent


def launch_env(env: "dict | None") -> dict:
    """A launch's environment: this process's, quiet, one thread, the repository importable, plus `env`."""
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}


def forking() -> bool:
    return os.environ.get("SNIP_TEST_FORK", "1") != "0"  # 0: every launch a process of its own, as before


def checked(proc: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, proc.args))} failed ({proc.returncode}):\n"
                             f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_distributed(target: list[str], nproc: int = 2, timeout: float = 300, env: "dict | None" = None,
                    check: bool = True, preload: tuple = MEGATRON_CORE) -> subprocess.CompletedProcess:
    """`target` is what follows torchrun's options, e.g. ["-m", "snip_megatron.megatron.smoke", "--tp", "2"]
    or ["path/to/script.py", "--flag"], run in ROOT; `env`: variables added to this process's;
    `preload`: tests/forked.py's. Raises AssertionError with the output if a rank fails (`check`)."""
    full_env = launch_env(env)
    if forking():
        return checked(launch(target, nproc=nproc, env=full_env, cwd=ROOT, timeout=timeout, preload=preload), check)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", *target]
    return checked(subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout), check)


def run_python(target: list[str], *, cwd: "str | os.PathLike", env: dict, timeout: float, check: bool = True,
               preload: tuple = MEGATRON_CORE) -> subprocess.CompletedProcess:
    """`python TARGET` in `cwd` with the full environment `env`, one process without torchrun's variables."""
    if forking():
        return checked(launch(target, torchrun=False, env=env, cwd=cwd, timeout=timeout, preload=preload), check)
    return checked(subprocess.run([sys.executable, *map(str, target)], cwd=cwd, env=env, capture_output=True,
                                  text=True, timeout=timeout), check)
