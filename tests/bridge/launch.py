"""Launches of tests/bridge/bridge_worker.py, one after another, from one process that imports once.

    python tests/bridge/launch.py LAUNCHES.json

LAUNCHES.json is a list of {"nproc": N, "argv": [worker arguments], "env": {variables}, "logs": folder}.
A torchrun of the worker spends most of each rank's CPU time importing torch, Megatron-Core,
Megatron-Bridge and transformers (about 13 s a process), which a chain of launches on two cores
pays again for every rank of every link. This launcher imports them once (with the TE double
where PYTHONPATH has it) and then, per launch, forks its N ranks from that state, each with
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus the launch's
`env`, running the worker's `main(argv)` in a fresh process as torchrun would, its output in
<logs>/rank<r>.log. Nothing is run in this process before a fork (no threads, no process group).
A launch with a failed rank stops the chain: its other ranks are killed, and this exits 1 after
printing the failed rank's log tail. Ranks die with the launcher (a test's timeout kills it).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))


def preload() -> None:
    """What every rank imports before it runs anything (bridge_worker.main's imports)."""
    import bridge_worker  # noqa: F401 - installs the lora_layers stand-in first
    import megatron.bridge.training.gpt_step  # noqa: F401
    import megatron.bridge.training.pretrain  # noqa: F401

    import megatron.bridge.models.hybrid.hybrid_provider  # noqa: F401
    import megatron.bridge.models.mla_provider  # noqa: F401
    import megatron.bridge.recipes.gpt.vanilla_gpt  # noqa: F401 - tiny.tiny_config's recipe

    import snip_megatron.bridge  # noqa: F401
    import snip_megatron.bridge.run  # noqa: F401
    import snip_megatron.controller  # noqa: F401
    import snip_megatron.stats.measure  # noqa: F401
    import snip_megatron.support.check  # noqa: F401
    import tests.bridge.cpu  # noqa: F401
    import tests.bridge.tiny  # noqa: F401
    import tests.pretrain.pretrain_worker  # noqa: F401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, nproc: int, port: int, launch: dict) -> None:
    """The forked rank: torchrun's environment, output to its log, the worker's main; never returns."""
    os.setpgid(0, 0)  # its own group: the launcher kills what it leaves behind (Bridge's checkpoint writer)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # and it ends with the launcher (a timeout)
    log = Path(launch["logs"]) / f"rank{rank}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1), os.dup2(fd, 2)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), **launch.get("env", {})})
    code = 0
    try:
        import bridge_worker

        bridge_worker.main(launch["argv"])
    except BaseException:  # noqa: BLE001 - any failure is the rank's exit status
        traceback.print_exc()
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(launch: dict) -> bool:
    """Fork the launch's ranks and wait for them; False (the others killed) if one failed."""
    Path(launch["logs"]).mkdir(parents=True, exist_ok=True)
    nproc, port = launch["nproc"], free_port()
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            rank_main(rank, nproc, port, launch)
        pids[pid] = rank
    failed = None
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid)
        if status != 0 and failed is None:
            failed = rank
            for other in pids:
                kill_group(other)
        kill_group(pid)  # what the rank left behind
    if failed is not None:
        log = (Path(launch["logs"]) / f"rank{failed}.log").read_text()
        print(f"launch {launch['argv']} failed on rank {failed}:\n{log[-8000:]}", flush=True)
    return failed is None


def main() -> None:
    launches = json.loads(Path(sys.argv[1]).read_text())
    preload()
    for launch in launches:
        if not run(launch):
            sys.exit(1)


if __name__ == "__main__":
    main()
