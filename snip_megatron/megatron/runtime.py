"""Process groups and Megatron's model-parallel state, on CPU (gloo) or GPU (NCCL).

Order matters (see notes in cpu_shim): init the torch process group, import megatron.core,
install the CPU shim where there is no GPU, initialize model parallelism, seed.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings

import torch
import torch.distributed as dist

from snip_megatron.megatron import cpu_shim


def quiet_megatron_warnings() -> None:
    """Silence the import-time notices Megatron prints when TE/apex are absent (expected on CPU)."""
    for pattern in (".*Transformer Engine.*", ".*Apex.*", ".*apex.*", ".*nvidia-modelopt.*",
                    ".*TorchFunctionMode.*", ".*torch.distributed.*_coalescing_manager.*"):
        warnings.filterwarnings("ignore", message=pattern)


def init_process_group(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Init torch.distributed from the torchrun environment, or as a single process without it.

    Returns (rank, world_size). A no-op if already initialised.
    """
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun, SLURM scripts
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # One process. No os.environ edits: child processes must not inherit this port.
            dist.init_process_group(backend=backend, timeout=timeout, rank=0, world_size=1,
                                    init_method=f"tcp://127.0.0.1:{_free_port()}")
    return dist.get_rank(), dist.get_world_size()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_model_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None,
                              seed: int = 1234, ep: int = 1, etp: int | None = None, cp: int = 1) -> None:
    """Set up Megatron's parallel_state (TP x CP x PP x DP over the world, and for MoE experts ETP x
    EP x expert-DP x PP; `etp` None: TP) and its RNG streams."""
    quiet_megatron_warnings()
    _, world = init_process_group()
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if vpp is not None and (not isinstance(vpp, int) or vpp < 1):
        raise ValueError(f"vpp must be a positive integer or None, got {vpp!r}")
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tp*cp*pp = {tp}*{cp}*{pp}")
    from megatron.core import parallel_state as ps

    cpu_shim.install()
    destroy()
    before = set(_registered_groups())
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    _megatron_groups[:] = [g for g in _registered_groups() if g not in before]
    seed_all(seed)


# The process groups the last initialize_model_parallel created, in creation order. Megatron's
# destroy_model_parallel forgets most of them without destroying them; on gloo each keeps its
# worker threads, so repeated in-process runs (the test suite, the benchmarks) would pile them up.
_megatron_groups: list = []


def _registered_groups() -> list:
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def seed_all(seed: int) -> None:
    """Seed torch and Megatron's model-parallel RNG tracker (needed: attention forks it)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy(process_group: bool = False) -> None:
    """Tear down Megatron's parallel state (and the torch process group if asked)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized() and dist.get_backend() == "gloo":
        # Newest first, as torch shuts groups down; every rank holds the same order.
        left = set(_registered_groups())
        for group in reversed(_megatron_groups):
            if group in left:
                dist.destroy_process_group(group)
    _megatron_groups.clear()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def megatron_runtime(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234):
    """`with megatron_runtime(tp=2): ...` -- parallel state up for the block, torn down after."""
    initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, seed=seed)
    try:
        yield
    finally:
        destroy()
