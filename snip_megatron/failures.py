"""What a failed measurement does: the policy of the controller's measurement step (DESIGN section 6).

Training goes on after a failed measurement with the plan it has; but a failure that repeats is a
stale plan in disguise (a Megatron internal SNIP measures through changed), so it is said, counted
and bounded:

- each failure logs its exception's first line at WARNING (on the rank that raised it) and counts
  in the run's loggers (`snip/measure_failures`, snip_megatron.loggers);
- the same failure at two measurements in a row stops re-planning, said once: the run goes on with
  its current plan, and a resumed run measures again;
- strict mode (SnipConfig.strict) stops the run at the first failure instead.

Every rank decides alike: one all-reduce (MAX) of this rank's verdict, which also carries whether
its failure repeated, so one collective per measurement step, as before.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

LOG = logging.getLogger("snip_megatron.measure")
OK, FAILED, REPEATED = 0, 1, 2
"""A rank's verdict on one measurement: it succeeded here, it failed, it failed as at the previous one."""
ANOTHER_RANK = "failed on another rank"
"""How stats.measure's agreed failure (MeasurementFailed) ends on a rank that had no cause of its own."""


def collective_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def all_reduce_max(value: int) -> int:
    """The largest of every rank's `value` (itself in one process): one all-reduce."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0])


def first_line(error: str) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else "(no message)"


class MeasurementFailures:
    """The failures of one run's measurements (`strict`: SnipConfig.strict; `loggers`:
    snip_megatron.loggers.RunLoggers; `log`: the console line rank 0 writes, "[snip] " added)."""

    def __init__(self, strict: bool = False, loggers=None, log=print):
        self.strict = strict
        self.loggers = loggers
        self._log = log
        self.count = 0
        """Failed measurements so far (every rank alike)."""
        self.last: "str | None" = None
        """This rank's own failure at the previous measurement (None: it did not fail here)."""
        self.stopped: "str | None" = None
        """Why re-planning stopped (None: it goes on)."""

    def agree(self, step: int, error: "str | None") -> bool:
        """Every rank, after the measurement of `step` (`error`: this rank's, None when it worked):
        True when it failed on any rank, and the update is skipped. Logs, counts, stops
        re-planning after the same failure twice in a row, or raises in strict mode."""
        own = None if error is None or str(error).endswith(ANOTHER_RANK) else first_line(error)
        if own is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            LOG.warning(f"[snip] rank {rank}: measurement at step {step} failed: {own}")
        verdict = OK if error is None else REPEATED if own is not None and own == self.last else FAILED
        self.last = own
        agreed = all_reduce_max(verdict)
        if agreed == OK:
            return False
        self.count += 1
        self._publish(step)
        said = own or "on another rank: see its warning"
        if self.strict:
            raise RuntimeError(f"SNIP: the measurement at step {step} failed ({said}) and strict mode is on "
                               "(--snip-strict, Bridge's snip.strict): stopping the run")
        if agreed == REPEATED:
            self.stopped = f"the measurement failed at two measurements in a row the same way ({said})"
            self._log(f"{self.stopped}, at step {step}: SNIP stops re-planning and the run goes on with its "
                      "current plan; fix the cause and resume to re-plan again, or turn strict mode on "
                      "(--snip-strict, Bridge's snip.strict) to stop the run at a failed measurement")
        else:
            self._log(f"measurement at step {step} failed ({said}); skipping this update, training "
                      "continues with the current plan")
        return True

    def _publish(self, step: int) -> None:
        from snip_megatron.loggers import MEASURE_FAILURES, write_scalars

        write_scalars(self.loggers, step, {MEASURE_FAILURES: float(self.count)})
