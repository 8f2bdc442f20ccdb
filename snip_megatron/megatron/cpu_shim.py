"""Run Megatron-Core's training paths on a CPU-only machine.

Megatron-Core assumes CUDA in ~50 places (``device="cuda"`` factories in the schedules, p2p,
RoPE, clip_grads and the optimizer; the CUDA RNG tracker that attention forks on every forward;
streams and events in the DDP grad sync). `install()` makes those work on CPU, process-locally:

1. a ``TorchFunctionMode`` maps ``device="cuda"``/``"cuda:N"``/int devices to CPU for factory
   functions and ``Tensor.to``, drops ``pin_memory=True`` (pinning needs a CUDA driver; RoPE's
   context-parallel slice asks for it), makes ``Tensor.cuda()`` a no-op, and reports CUDA type
   names from ``Tensor.type()`` (``clip_grads.py`` asserts ``'torch.cuda.FloatTensor'``);
2. ``torch.cuda.{current_device, synchronize, current_stream, default_stream, Stream, Event,
   stream, get_rng_state, set_rng_state, manual_seed, manual_seed_all}`` get CPU stand-ins;
   ``torch.cuda.is_available()`` stays False;
3. Megatron's ``_get/_set_cuda_rng_state`` point at the CPU RNG so
   ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` work;
4. a backward started from Python (Megatron's recompute calls ``torch.autograd.backward`` inside a
   backward) runs with the mode on.
5. ``--moe-token-dispatcher-type alltoall`` runs over gloo: its split sizes become the numpy
   arrays they are on a GPU (`_splits_to_cpu`), and its gather over expert TP of parts of unequal
   sizes, which gloo's all_gather refuses, goes through equal padded parts (`_uneven_gather`).

`uninstall()` restores every patched attribute. Both are no-ops when CUDA is available.
Order: init the process group -> import megatron.core -> install() -> initialize_model_parallel.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

_SAVED: dict[tuple[object, str], object] = {}
_MODE: "CudaToCpuMode | None" = None


def _to_cpu_device(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):  # torch.cuda.current_device() -> 0
        return torch.device("cpu")
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch function call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _to_cpu_device(kwargs["device"])}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if (func is torch.Tensor.to and len(args) > 1
                and isinstance(args[1], (str, torch.device, int)) and not isinstance(args[1], bool)):
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _Event:
    def __init__(self, *args, **kwargs): pass
    def record(self, *args, **kwargs): pass
    def wait(self, *args, **kwargs): pass
    def synchronize(self): pass
    def query(self): return True
    def elapsed_time(self, other): return 0.0


class _Stream:
    def __init__(self, *args, **kwargs): pass
    def wait_event(self, *args, **kwargs): pass
    def wait_stream(self, *args, **kwargs): pass
    def synchronize(self): pass
    def record_event(self, *args, **kwargs): return _Event()
    def query(self): return True


def _backward_in_mode(run_backward):
    """torch.autograd's engine call, run with the mode on: torch takes a mode off its stack while the
    mode handles a call, so a backward started from Python inside one (torch.autograd.backward in
    Megatron's recompute, Tensor.backward) would run its nodes' Python without it."""

    def run(*args, **kwargs):
        if any(isinstance(m, CudaToCpuMode) for m in _function_modes()):
            return run_backward(*args, **kwargs)
        with CudaToCpuMode():
            return run_backward(*args, **kwargs)

    return run


def _function_modes() -> list:
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()


def _patch(obj, name: str, value) -> None:
    _SAVED.setdefault((obj, name), getattr(obj, name, None))
    setattr(obj, name, value)


def _splits_to_cpu(original):
    """Megatron's alltoall dispatcher moves its split sizes off the GPU with
    ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` (transformer/moe/token_dispatcher.py:930-938
    @0.19.2), which turns only a CUDA tensor into numpy (moe_utils.py:1184-1187): on the CPU
    the splits stay tensors and reach ``all_to_all_single`` (tensor_parallel/mappings.py:460), whose
    split-size arguments take lists. This converts a CPU tensor asked for as numpy, the one thing
    the GPU path does that the CPU path skips; everything else goes to Megatron's function."""

    def to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return to_cpu


def _uneven_gather(original):
    """Megatron's alltoall dispatcher gathers its tokens over expert TP with each rank's count
    (token_dispatcher.py:734-744 @0.19.2) through ``_gather_along_first_dim`` with
    ``output_split_sizes``, which hands ``torch.distributed.all_gather`` a list of unequal parts
    (tensor_parallel/mappings.py:147-154): NCCL gathers them, gloo refuses ("invalid tensor size").
    Here every rank's part is padded to the largest with zero rows, gathered, and cut back to its
    size: the output Megatron's gather gives. Equal or no split sizes go to Megatron's function."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        import torch.distributed as dist

        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)])

    return gather


def needed() -> bool:
    """The shim is needed only where CUDA is not available."""
    return not torch.cuda.is_available()


def is_installed() -> bool:
    return bool(_SAVED)


def suspended():
    """A context in which torch calls bypass the shim's mode: for hook code that creates no CUDA
    tensors (per-operand statistics), where the mode's Python dispatch costs more than the small
    ops themselves. A no-op context when the shim is not installed."""
    return torch._C.DisableTorchFunction() if _MODE is not None else contextlib.nullcontext()


def install() -> bool:
    """Install the shim; returns True if it did something (False on a CUDA machine or if already in)."""
    global _MODE
    if not needed() or is_installed():
        return False
    stream = _Stream()
    _patch(torch.cuda, "current_device", lambda: 0)  # 0 is mapped to cpu by the mode
    _patch(torch.cuda, "synchronize", lambda *a, **k: None)
    _patch(torch.cuda, "current_stream", lambda *a, **k: stream)
    _patch(torch.cuda, "default_stream", lambda *a, **k: stream)
    _patch(torch.cuda, "Stream", _Stream)
    _patch(torch.cuda, "Event", _Event)
    _patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    _patch(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _patch(torch.cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state))
    _patch(torch.cuda, "manual_seed", lambda seed: None)  # the CPU RNG is seeded by torch.manual_seed
    _patch(torch.cuda, "manual_seed_all", lambda seed: None)
    import torch.cuda.random as cuda_random

    _patch(cuda_random, "get_rng_state", torch.cuda.get_rng_state)
    # The tracker warns that the CPU RNG changed inside a "GPU" RNG context: here they are one RNG.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    try:
        import megatron.core.tensor_parallel.random as mrandom
    except Exception:  # megatron missing or broken: the torch part of the shim still helps
        mrandom = None
    if mrandom is not None:
        _patch(mrandom, "_get_cuda_rng_state",
               lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
        _patch(mrandom, "_set_cuda_rng_state",
               lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    _patch(torch.autograd, "_engine_run_backward", _backward_in_mode(torch.autograd._engine_run_backward))
    try:
        from megatron.core.tensor_parallel import mappings
        from megatron.core.transformer.moe import token_dispatcher
    except Exception:  # megatron missing or broken
        mappings = token_dispatcher = None
    if getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None) is not None:
        _patch(token_dispatcher, "maybe_move_tensor_to_cpu", _splits_to_cpu(token_dispatcher.maybe_move_tensor_to_cpu))
    if getattr(mappings, "_gather_along_first_dim", None) is not None:
        _patch(mappings, "_gather_along_first_dim", _uneven_gather(mappings._gather_along_first_dim))
    _MODE = CudaToCpuMode()
    _MODE.__enter__()
    return True


def uninstall() -> None:
    """Undo install(): every patched attribute gets its original value back."""
    global _MODE
    if _MODE is not None:
        _MODE.__exit__(None, None, None)
        _MODE = None
    for (obj, name), value in reversed(list(_SAVED.items())):
        setattr(obj, name, value)
    _SAVED.clear()
