"""Step hooks: how the SNIP controller (and anything else) joins the training loop.

Per step the trainer calls, on every rank and in registration order:

    on_step_start(trainer, step)            # the step's micro-batches are in trainer.current_batch;
                                            # extra passes: trainer.forward_backward(...)
    ... forward/backward, optimizer step, scheduler step ...
    on_step_end(trainer, step, metrics)     # metrics: loss, lr, grad_norm, ... (same on every rank)

A hook's `state_dict()` goes into every checkpoint and comes back through `load_state_dict()` on
resume. It must be JSON-serialisable (plans, statistics as lists of floats, step numbers): hook
state is stored as JSON text, never pickled.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from snip_megatron.train.loop import Trainer


class StepHook:
    """Base class with no-op defaults; subclasses override what they need."""

    name: str = "hook"
    """Key of this hook's state in checkpoints; unique among a trainer's hooks."""

    def on_train_start(self, trainer: "Trainer") -> None:
        """After setup and any resume, before the first step."""

    def on_step_start(self, trainer: "Trainer", step: int) -> None:
        """Before the forward/backward of `step` (1-based); trainer.current_batch is that step's data."""

    def on_step_end(self, trainer: "Trainer", step: int, metrics: dict) -> None:
        """After the optimizer and scheduler step of `step`."""

    def state_dict(self) -> dict:
        """JSON-serialisable state saved in checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned."""


def hooks_to_json(hooks: list[StepHook]) -> str:
    """Every hook's state as one JSON document; raises ValueError naming a hook whose state is not JSON."""
    states = {}
    for hook in hooks:
        try:
            json.dumps(hook.state_dict(), allow_nan=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"step hook {hook.name!r}: state_dict() is not JSON-serialisable ({e})") from None
        states[hook.name] = hook.state_dict()
    return json.dumps(states, sort_keys=True)


def hooks_from_json(hooks: list[StepHook], text: str) -> list[str]:
    """Give each hook its saved state; returns the names of saved states no hook claimed."""
    states = json.loads(text)
    for hook in hooks:
        if hook.name in states:
            hook.load_state_dict(states[hook.name])
    names = {h.name for h in hooks}
    return sorted(k for k in states if k not in names)


def check_unique_names(hooks: list[StepHook]) -> None:
    names = [h.name for h in hooks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"step hooks share names {dup}: each hook needs its own `name` (its checkpoint key)")
