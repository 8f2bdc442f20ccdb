"""The environment of one Megatron-LM process on one GPU started without a launcher.

Megatron-LM's `initialize_megatron` opens its process group from the environment (env://), as
torchrun sets it up: without MASTER_ADDR and MASTER_PORT the first run stops with "MASTER_ADDR
expected". The GPU scripts that start `snip-pretrain-gpt` or `snip-pretrain-hybrid` in a subprocess
give it this environment: one rank on this host, a free port, the repository on PYTHONPATH, and the
NCCL and gloo sockets on the loopback interface (nothing else is reachable on a lent machine).
"""

from __future__ import annotations

import os
import socket

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env(base: "dict | None" = None) -> dict:
    """`base` (default os.environ) with rank 0 of a world of one on 127.0.0.1 and the repository
    first on PYTHONPATH; an existing launcher's rank variables are replaced (the child is a world
    of its own), socket interface choices already made are kept."""
    env = dict(os.environ if base is None else base)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env
