"""One measurement of a loaded checkpoint, as each loop hands it to the planning step."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from snip_megatron.config import SnipConfig


@dataclass
class Measurement:
    """What the loop measured at the checkpoint's step, and how it plans."""

    stats: Any
    """The reduced StatsTable (global rank 0; None on the other ranks)."""
    snip: SnipConfig
    """The run's SNIP settings, resolved for its backend (formats, precisions, budget kind)."""
    controller_for: Callable[[SnipConfig], Any]
    """The run's SnipController for a config (its FLOP table, stages and exclusions)."""
    step: int
    """The checkpoint's step."""
    measured: int
    """Micro-batches measured (over every data-parallel replica)."""
    seconds: float
    """Wall time of the measurement."""
    pp: int = 1
    vpp: Optional[int] = None
    layout_error: Optional[str] = None
    """Why the static recipes cannot be written for the run's layout (an uneven pipeline split)."""
    sm: Optional[int] = None
    """The GPU the run's Transformer Engine linears ran on (None: emulated linears)."""
    pattern: Optional[str] = None
    """A HybridModel's --hybrid-layer-pattern (its static recipes' module paths and pipeline segments)."""
    close: Callable[[], None] = lambda: None
    """Tears the loop down once the plans are solved."""

    @property
    def is_writer(self) -> bool:
        """Global rank 0 holds the table, solves and writes."""
        return self.stats is not None


def measured_count(num_local: int, dp: int, k: "int | None") -> int:
    """Micro-batches a measurement of K runs in a step of `num_local` per replica (stats/microbatches.py)."""
    from snip_megatron.stats.microbatches import sample_microbatches

    return sample_microbatches(num_local, 0, dp, k)[1]


def uneven_split(settings: dict, pin: str) -> "str | None":
    """Why the static recipes cannot be written where a pipeline split setting is given ({the
    setting as the user writes it: its value}): their module paths follow Megatron's even split
    only. `pin`: how this loop pins the JSON plan instead."""
    for name, value in settings.items():
        if value is not None:
            return (f"not written: {name} splits the pipeline unevenly, which a per-module config "
                    f"cannot express; pin the JSON plan ({pin}) instead")
    return None


def said_before(call: Callable, *args, **kwargs):
    """`call(*args, **kwargs)` without what it prints: the start-up lines (an MoE model's notice, the
    MTP and TE exclusions) the run's own set-up printed once already, not again per budget."""
    with contextlib.redirect_stdout(io.StringIO()):
        return call(*args, **kwargs)
