"""SnipCallback: the Megatron-Bridge callback events a SNIP run listens to (what enable_snip returns).

    on_train_start      this pretrain() is the run's (the train_step seam acts only for it)
    on_train_step_end   the step's loss to the controller (loss guard), on every rank
    on_checkpoint_save  a checkpoint is final: SNIP's state of its iteration goes beside it
    on_train_end        the run is over: the process has no active SNIP run any more

The measurement and the plan switch run before each step in the wrapped train_step
(snip_megatron.bridge.seams), which has the data iterator that callbacks do not get.
"""

from __future__ import annotations

from megatron.bridge.training.callbacks import Callback


class SnipCallback(Callback):
    """SNIP's Bridge callback for one run (a snip_megatron.bridge.run.BridgeRun)."""

    def __init__(self, run):
        self.run = run

    def on_train_start(self, context) -> None:
        self.run.state = context.state
        self.run.controller  # noqa: B018 - raises, naming the fix, if the model skipped SnipLayerSpec

    def on_train_step_end(self, context) -> None:
        step = context.state.train_state.step + 1  # Bridge counts the step after this event
        loss = (context.loss_dict or {}).get("lm loss")
        self.run.loop.step_end(step, loss)

    def on_checkpoint_save(self, context) -> None:
        self.run.write_saved()

    def on_train_end(self, context) -> None:
        from snip_megatron.bridge.run import deactivate

        deactivate(self.run)
