"""Launch a Python script or module in N local processes forked from one that has imported torch,
Megatron and SNIP once: what `python -m torch.distributed.run --nproc_per_node=N TARGET` or
`python TARGET` does for a test, without each process importing them again.

Each process of a test's launch spends most of its CPU time importing torch, Megatron-Core and
Megatron-LM (several seconds), which a chain of launches on two cores pays again for every rank of
every link, plus torchrun's own start. Here a server (this file run as a script) imports them once
and, per launch, forks its ranks from that state: each gets the launch's environment (torchrun's
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT added for a torchrun-like launch), its
working folder, `sys.argv` and `sys.path[0]` as the interpreter would set them, then runs the target
as `__main__`, and exits as Python would (non-daemon threads joined, atexit handlers run). Its
stdout and stderr go to the launch's files, all ranks appending, as torchrun's children share its
pipes. A launch whose rank fails has its other ranks killed (torchrun's agent stops them too).

A server serves the launches whose environment matches the one it started with, but for the
variables read at run time (RUN_TIME_VARIABLES: the TE double's GPU and CUDA, the probes'
settings): anything else (PYTHONPATH, OMP_NUM_THREADS, NVTE_* read by TE at import) takes effect at
import, so another value gets another server. A server serves one launch at a time (launches at once,
from threads, get a server each); idle servers live for the test session (a few at most, the least
recently used closed first); a launch that times out or is interrupted kills its server, and with
it its ranks.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = ("torch", "torch.distributed")
"""What a server imports before it forks, at the least: what every launched target imports. A module the
target would not import could change what it does (megatron.training points the root logger at stdout, say)."""
MEGATRON_CORE = (*TORCH, "megatron.core", "megatron.core.models.gpt.gpt_layer_specs")
"""For a launch that builds Megatron-Core models (megatron.core sets up nothing global at import)."""
MEGATRON_LM = (*MEGATRON_CORE, "megatron.training.training", "megatron.training.arguments",
               "snip_megatron.pretrain.setup", "snip_megatron.controller", "snip_megatron.stats.measure")
"""For a launch of Megatron-LM's loop with SNIP (snip-pretrain-gpt, snip-analyze, their test workers),
where importable (megatron.training ships with megatron-core >= 0.19; the TE double, where PYTHONPATH
has it, comes in through megatron.core)."""
RUN_TIME_VARIABLES = ("TE_DOUBLE_", "PROBE_", "ANALYZE_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                      "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTEST_")
"""Environment variables (names or prefixes) read when a launch runs, not at import: a server
serves launches that differ only in these."""
MAX_SERVERS = 4
PR_SET_PDEATHSIG = 1  # linux/prctl.h


# ---- the server (this file as a script) --------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_target(target: list[str]) -> None:
    """Run `target` (["-m", module, *args] or [script, *args]) as this process's `__main__`."""
    import runpy

    if target[0] == "-m":
        sys.argv = ["-m", *target[2:]]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(target[1], alter_argv=True)  # what `python -m` calls
        return
    script = os.path.abspath(target[0])
    sys.argv = list(target)
    sys.path[0] = os.path.dirname(script)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __builtins__=__builtins__, __cached__=None)
    sys.modules["__main__"] = main
    code = compile(Path(script).read_bytes(), script, "exec")
    exec(code, main.__dict__)


def exit_as_python_would(code: int) -> None:
    """Join non-daemon threads, run atexit handlers, flush, then leave without the server's state."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the rank's status stands
        import traceback

        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def start_checkpoint_results_queue() -> None:
    """Megatron's torch_dist save collects its writes' results through a multiprocessing Manager's
    queue it starts once per process with the 'spawn' method (dist_checkpointing/strategies/
    filesystem_async.py, `_results_queue`): a fresh interpreter that imports the rank's `__main__`,
    over a second of CPU for every rank of every launch that saves. A rank forked from a server that
    imported Megatron starts that queue here, with 'fork' as Megatron's persistent async checkpoint
    worker does (training/async_utils.py), while it is still one thread; the queue and the writes
    through it stay Megatron's."""
    if "megatron.core" not in sys.modules:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        import multiprocessing

        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def rank_main(rank: int, launch: dict, port: int) -> None:
    """The forked rank: the launch's environment, folder and output files, the target; never returns
    (whatever fails, the rank's status says so and the server's loop does not go on in it)."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: what it starts is killed with it
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # and it ends with the server
        for fd, path in ((1, launch["stdout"]), (2, launch["stderr"])):
            opened = os.open(path.replace("{rank}", str(rank)), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.dup2(opened, fd)
            os.close(opened)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(launch["env"])
        if launch["torchrun"]:
            nproc = launch["nproc"]
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.chdir(launch["cwd"])
        start_checkpoint_results_queue()
        code = 0
        run_target(launch["target"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - any failure is the rank's exit status
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        exit_as_python_would(code)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def serve_launch(launch: dict) -> list[int]:
    """Fork the launch's ranks and wait for them; their exit codes (the others killed if one failed)."""
    port = free_port()
    pids = {}
    for rank in range(launch["nproc"]):
        pid = os.fork()
        if pid == 0:
            rank_main(rank, launch, port)
        pids[pid] = rank
    codes = [0] * launch["nproc"]
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid)
        codes[rank] = os.waitstatus_to_exitcode(status)
        if codes[rank] != 0:
            for other in pids:
                kill_group(other)
        kill_group(pid)  # what the rank left behind
    return codes


def serve(preload: list[str], reply_fd: int) -> None:
    import importlib

    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # Forking is safe only from one thread (a lock held by another would stay held in the ranks).
    assert threading.active_count() == 1, f"a preloaded module started threads: {threading.enumerate()}"
    # The preloaded objects out of the collector's reach: a rank's collections then leave their pages
    # alone, so they stay shared with the server instead of being copied into every rank.
    import gc

    gc.collect()
    gc.freeze()
    with os.fdopen(reply_fd, "w") as reply:
        reply.write("ready\n")
        reply.flush()
        for line in sys.stdin:
            codes = serve_launch(json.loads(line))
            reply.write(json.dumps(codes) + "\n")
            reply.flush()


# ---- the client (imported by the tests) --------------------------------------------------------

class Server:
    def __init__(self, env: dict, preload: tuple):
        read, write = os.pipe()
        self.log = tempfile.NamedTemporaryFile(prefix="snip-forked-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, __file__, str(write), *preload], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, pass_fds=(write,),
                                     text=True, start_new_session=True)
        os.close(write)
        self.replies = os.fdopen(read)
        if self.read_line(timeout=300) != "ready":
            raise RuntimeError(f"the fork server did not start:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text()[-6000:]

    def read_line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.replies], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(self.proc.args, timeout)
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the fork server ended ({self.proc.wait()}):\n{self.output()}")
        return line.strip()

    def launch(self, launch: dict, timeout: float) -> list[int]:
        self.proc.stdin.write(json.dumps(launch) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.read_line(timeout))

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.replies.close()
        os.unlink(self.log.name)


IDLE: "OrderedDict[tuple, list[Server]]" = OrderedDict()
"""The servers not serving a launch, by key, the least recently used first."""
LOCK = threading.Lock()


def server_key(env: dict, preload: tuple) -> tuple:
    """(interpreter, preload, the environment a server starts with: `env` without RUN_TIME_VARIABLES)."""
    fixed = sorted((k, v) for k, v in env.items() if not k.startswith(RUN_TIME_VARIABLES))
    return (sys.executable, preload, tuple(fixed))


def take_server(key: tuple) -> Server:
    """An idle server for `key` (server_key's), or a new one (launches at once, from threads, get one each)."""
    with LOCK:
        if IDLE.get(key):
            IDLE.move_to_end(key)
            return IDLE[key].pop()
    _, preload, fixed = key
    return Server(dict(fixed), preload)


def give_back(key: tuple, server: Server) -> None:
    with LOCK:
        IDLE.setdefault(key, []).append(server)
        IDLE.move_to_end(key)
        while sum(map(len, IDLE.values())) > MAX_SERVERS:
            oldest = next(iter(IDLE))
            IDLE[oldest].pop(0).close()
            if not IDLE[oldest]:
                del IDLE[oldest]


@atexit.register
def close_servers() -> None:
    with LOCK:
        while IDLE:
            for server in IDLE.popitem()[1]:
                server.close()


def launch(target: list, *, nproc: int = 1, torchrun: bool = True, env: dict, cwd: "str | os.PathLike",
           timeout: float, preload: tuple = MEGATRON_CORE,
           rank_logs: "str | os.PathLike | None" = None) -> subprocess.CompletedProcess:
    """Run `target` (["-m", module, *args] or [script, *args]) in `nproc` forked processes with the
    full environment `env` in `cwd`; `torchrun`: with torchrun's variables (else one process, as
    `python TARGET`); `preload`: what the server imports first (TORCH, MEGATRON_CORE, MEGATRON_LM).
    Returns its exit status (0, or a failed rank's) and output, or, with `rank_logs`, no
    output: each rank's stdout and stderr together in rank_logs/rank<r>.log."""
    key = server_key(env, preload)
    server = take_server(key)
    with tempfile.TemporaryDirectory(prefix="snip-launch-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        if rank_logs is not None:
            Path(rank_logs).mkdir(parents=True, exist_ok=True)
            out = err = Path(rank_logs) / "rank{rank}.log"
        request = {"target": [str(t) for t in target], "nproc": nproc, "torchrun": torchrun, "env": env,
                   "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        try:
            codes = server.launch(request, timeout)
        except BaseException:
            server.close()  # its ranks die with it
            raise
        give_back(key, server)
        failed = [c for c in codes if c > 0] or [c for c in codes if c != 0]  # a rank's own status before a kill
        status = failed[0] if failed else 0
        args = ["forked", f"nproc={nproc}", *request["target"]]
        if rank_logs is not None:
            return subprocess.CompletedProcess(args, status, "", "")
        return subprocess.CompletedProcess(args, status, out.read_text(), err.read_text())


if __name__ == "__main__":
    serve(sys.argv[2:], int(sys.argv[1]))
