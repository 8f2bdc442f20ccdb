"""Step hooks and the step context: how the SNIP controller (or any hook) joins a training loop.

Both loops give their hooks the same `StepContext` and call, on every rank, in registration order:

    on_train_start(ctx)                     # after set-up and any resume, before the first step
    on_step_start(ctx, step)                # ctx.current_batch holds the micro-batches `step` trains on
    ... forward/backward, optimizer step, scheduler step ...
    on_step_end(ctx, step, metrics)         # metrics: {"loss": ..., ...}

The loops: the compact loop (`snip_megatron.train.Trainer`, which is its own context) and
Megatron-LM's (`snip_megatron.pretrain`, whose context is a `MegatronStep` made at each step
boundary). A hook's `state_dict()` goes into every checkpoint and comes back through
`load_state_dict()` on resume. It must be JSON-serialisable (plans, statistics as lists of floats,
step numbers): hook state is stored as JSON text, never pickled.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Protocol


class StepContext(Protocol):
    """What a hook sees of the training loop at a step boundary (on every rank)."""

    step: int
    """Optimizer steps completed."""
    chunks: list
    """This rank's model chunks (DDP-wrapped; several with virtual pipelining)."""
    optimizer: Any
    """Megatron's optimizer (its Adam moments feed the weight divergence)."""
    forward_step_func: Callable
    """Megatron's `forward_step(data_iterator, model) -> (output, loss_func)` of this loop."""
    seq_length: int
    """Tokens per sample."""
    micro_batch_size: int
    """Samples per micro-batch."""

    @property
    def current_batch(self) -> list:
        """The micro-batches of the step about to run (the loop then trains on exactly these)."""

    def set_plan(self, plan) -> None:
        """Run this rank's planned linears at `plan`'s precisions from now on (every rank, same step)."""


class StepHook:
    """Base class with no-op defaults; subclasses override what they need."""

    name: str = "hook"
    """Key of this hook's state in checkpoints; unique among a trainer's hooks."""

    def on_train_start(self, ctx: StepContext) -> None:
        """After setup and any resume, before the first step."""

    def on_step_start(self, ctx: StepContext, step: int) -> None:
        """Before the forward/backward of `step` (1-based); ctx.current_batch is that step's data."""

    def on_step_end(self, ctx: StepContext, step: int, metrics: dict) -> None:
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
