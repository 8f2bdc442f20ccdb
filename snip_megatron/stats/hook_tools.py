"""The plumbing of the collector's hooks (collector.py): running a hook outside the CPU shim's mode
with its errors caught, and numbering a linear's forwards by micro-batch under activation recompute."""

from __future__ import annotations

import collections
import functools

import torch


def plain(fn, errors: "list | None" = None, where: str = ""):
    """Run a hook without the CPU shim's TorchFunctionMode (megatron/cpu_shim.py): the statistics
    create no CUDA tensors, and the mode's per-op Python dispatch is a large part of their cost.

    With `errors`, an exception in the hook is recorded there (and the hook leaves the pass as if it
    were absent), so this rank runs the rest of the pass, and its collectives, like every other; the
    measurement then agrees across ranks to skip the update (measure.py)."""
    from snip_megatron.megatron import cpu_shim

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with cpu_shim.suspended():
            if errors is None:
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a failed statistic never stops training
                errors.append(f"{where}: {type(exc).__name__}: {exc}")
                return None

    return run


class MicrobatchIds:
    """Micro-batch index of each forward of one linear, recompute-aware: a no-grad forward is the
    first forward of a checkpointed layer (its index waits for the recompute); a grad forward while
    some wait is that recompute (oldest first); any other forward is a new micro-batch."""

    def __init__(self):
        self.next = 0
        self.waiting = collections.deque()

    def forward(self) -> tuple[int, bool]:
        if not torch.is_grad_enabled():
            mb = self.next
            self.next += 1
            self.waiting.append(mb)
            return mb, False
        if self.waiting:
            return self.waiting.popleft(), True
        mb = self.next
        self.next += 1
        return mb, True
