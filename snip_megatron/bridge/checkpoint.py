"""SNIP's state with Megatron-Bridge's checkpoints: saved with the checkpoint of its iteration,
loaded for the iteration Bridge loads.

Bridge saves and loads through a CheckpointManager (`checkpoint.custom_manager_class`, a class
name it instantiates); `enable_snip` names `SnipCheckpointManager`, which does what the configured
manager (Bridge's DefaultCheckpointManager, or the user's own class) does, plus:

- save: SNIP's state of that moment is taken on every rank (the controller may wait for its
  solver), and written beside the checkpoint, as `<save>/iter_<N>/snip_state.json` on rank 0,
  once Bridge says the checkpoint is final: its `on_checkpoint_save` event, which Bridge fires
  after a synchronous save and as a finalize step of an asynchronous one, oldest save first;
- load: the model is built before Bridge loads anything, so `bridge.state.expected_resume` reads the
  state of the checkpoint Bridge will load (`checkpoint.ckpt_step`, else its tracker) before the model is
  built; after the load the manager checks the iteration Bridge actually loaded, and if it is
  another one the run takes that checkpoint's state (`BridgeRun.after_load`).

The file format is the Megatron-LM loop's (snip_megatron.pretrain.state): Bridge writes the same
`iter_<N>` folders and the same `latest_checkpointed_iteration.txt` tracker.
"""

from __future__ import annotations

import importlib

MANAGER = f"{__name__}.SnipCheckpointManager"
"""The value enable_snip gives `checkpoint.custom_manager_class`."""


def _manager_class(name: "str | None"):
    if name is None:
        from megatron.bridge.training.checkpointing import DefaultCheckpointManager

        return DefaultCheckpointManager
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)


class SnipCheckpointManager:
    """Bridge's CheckpointManager protocol: the configured manager's save/load, with SNIP's state."""

    def __init__(self, checkpoint_config) -> None:
        from snip_megatron.bridge.run import active

        run = active()
        self.inner = _manager_class(getattr(run, "inner_manager", None))(checkpoint_config)

    @property
    def checkpointing_context(self) -> dict:
        return getattr(self.inner, "checkpointing_context", {})

    def save(self, ctx, callback_manager) -> None:
        from snip_megatron.bridge.run import active

        run = active(ctx.state.cfg)
        if run is not None and run.loop is not None and not ctx.non_persistent_ckpt:
            run.snapshot(ctx.state.train_state.step, ctx.state.cfg.checkpoint.save)
        self.inner.save(ctx, callback_manager)

    def load(self, ctx):
        from snip_megatron.bridge.run import active

        result = self.inner.load(ctx)
        run = active(ctx.state.cfg)
        if run is not None:
            step = int(ctx.state.train_state.step)
            run.after_load(None if ctx.state.cfg.checkpoint.finetune or step == 0 else step)
        return result

    def finalize_async_saves(self, state, blocking: bool = False, terminate: bool = False) -> None:
        self.inner.finalize_async_saves(state, blocking=blocking, terminate=terminate)
