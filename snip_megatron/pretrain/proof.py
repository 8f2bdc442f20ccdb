"""Proof, once a Megatron-LM run is under way, that SNIP's seams into its loop run.

The start-up checks (snip_megatron.megatron.seam_check) read Megatron's code; a loop that reaches
train_step or save_checkpoint by a route they do not know gets past them, and then the run trains
its initial plan, never measures, never writes snip_state.json, and says nothing. So:

- the step: from set-up until SNIP's step hook first runs, one global forward pre-hook stops the
  run at the first forward of a Megatron language model in training mode (a step SNIP's wrapper
  of train_step never saw); the first step hook removes it, so it costs nothing afterwards;
- the save: at each step, the iteration before it, when Megatron's `--save-interval` saved it,
  must have gone through SNIP's wrapper of save_checkpoint; and the first snip_state.json SNIP
  writes must sit in the folder Megatron's tracker file names, where a resumed run looks for it.

Each stops the run (SystemExit: every rank that sees it) naming the seam and Megatron's version.
"""

from __future__ import annotations

from typing import Optional

from snip_megatron.pretrain.state import STATE_FILE, TRACKER_FILE, iteration_folder, loaded_iteration_of

STEP = "megatron.training.training.train_step"
SAVE = "megatron.training.training.save_checkpoint"
_ARMED: list = []
"""The proof whose step hook is armed in this process (one at most: a new run's replaces it)."""


def _stop(what: str) -> SystemExit:
    from snip_megatron.megatron.seam_check import versions

    return SystemExit(f"SNIP: {what} ({versions()}). Stopping rather than training without SNIP: use a Megatron "
                      "release snip-megatron supports (docs/seams.md), or update snip-megatron")


class RunProof:
    """The run-time proofs of one run (`save`, `save_interval`: Megatron-LM's --save and
    --save-interval)."""

    def __init__(self, save: Optional[str] = None, save_interval: Optional[int] = None):
        self.save = save
        self.save_interval = save_interval
        self.first_step: Optional[int] = None
        self.last_saved: Optional[int] = None
        self.state_checked = False
        self._handle = None

    def arm(self) -> None:
        """Stop the run at a training forward of a language model before the first step hook."""
        import torch
        from megatron.core.models.common.language_module.language_module import LanguageModule

        for other in list(_ARMED):
            other.disarm()

        def before_forward(module, args):
            if module.training and isinstance(module, LanguageModule):
                self.disarm()
                raise _stop(f"Megatron ran a training forward of {type(module).__name__} before SNIP's step hook "
                            f"ever ran: its loop does not call SNIP's wrapper of {STEP}, so the run would train "
                            "its initial plan and never re-plan")

        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
        _ARMED.append(self)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self in _ARMED:
            _ARMED.remove(self)

    def step_begins(self, step: int) -> None:
        """SNIP's step hook, before step `step` trains."""
        self.disarm()
        if self.first_step is None:
            self.first_step = step
        done = step - 1
        if (done >= self.first_step and self.save and self.save_interval and done % self.save_interval == 0
                and self.last_saved != done):
            raise _stop(f"Megatron saved iteration {done} (--save-interval {self.save_interval}) without SNIP's "
                        f"wrapper of {SAVE}, so that checkpoint has no {STATE_FILE} and a resumed run would lose its "
                        "plan")

    def saving(self, iteration: int) -> None:
        """SNIP's save wrapper, at a persistent save of `iteration`."""
        self.last_saved = iteration

    def state_written(self, iteration: int, save_dir: str) -> None:
        """After SNIP wrote its state of `iteration` (rank 0): the first time, it must be where a
        resumed run will look, the folder of the iteration Megatron's tracker names."""
        if self.state_checked:
            return
        self.state_checked = True
        path = iteration_folder(save_dir, iteration) / STATE_FILE
        tracked = loaded_iteration_of(save_dir)
        if tracked != iteration or not path.is_file():
            raise _stop(f"after {SAVE} saved iteration {iteration}, Megatron's tracker {save_dir}/{TRACKER_FILE} "
                        f"names {tracked!r} and {path} {'exists' if path.is_file() else 'does not exist'}: a "
                        "resumed run would not find SNIP's state")
