"""SNIP's state with Megatron-Bridge's checkpoints: saved with the checkpoint of its iteration,
loaded for the iteration Bridge loads.

Bridge saves and loads through a CheckpointManager (`checkpoint.custom_manager_class`, a class
name it instantiates); `enable_snip` names `SnipCheckpointManager`, which does what the configured
manager (Bridge's DefaultCheckpointManager, or the user's own class) does, plus:

- save: SNIP's state of that moment is taken on every rank (the controller may wait for its
  solver), and written beside the checkpoint, as `<save>/iter_<N>/snip_state.json` on rank 0,
  once Bridge says the checkpoint is final: its `on_checkpoint_save` event, which Bridge fires
  after a synchronous save and as a finalize step of an asynchronous one, oldest save first;
- load: the model is built before Bridge loads anything, so `expected_resume` reads the state of
  the checkpoint Bridge will load (`checkpoint.ckpt_step`, else its tracker) before the model is
  built; after the load the manager checks the iteration Bridge actually loaded, and if it is
  another one the run takes that checkpoint's state (`BridgeRun.after_load`).

The file format is the Megatron-LM loop's (snip_megatron.pretrain.state): Bridge writes the same
`iter_<N>` folders and the same `latest_checkpointed_iteration.txt` tracker.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Optional

from snip_megatron.pretrain.state import STATE_FILE, iteration_folder, loaded_iteration_of, read_state_file

MANAGER = f"{__name__}.SnipCheckpointManager"
"""The value enable_snip gives `checkpoint.custom_manager_class`."""


def _is_iteration_dir(path) -> bool:
    from megatron.bridge.training.utils.checkpoint_utils import is_checkpoint_iteration_directory

    return bool(path) and is_checkpoint_iteration_directory(str(path))


def read_state_at(load: "str | None", iteration: int) -> Optional[dict]:
    """The SNIP state of checkpoint `iteration` under `load` (or of `load` itself when it is an
    iteration folder), None where that checkpoint was written without SNIP."""
    if not load:
        return None
    folder = Path(load) if _is_iteration_dir(load) else iteration_folder(load, iteration)
    return read_state_file(folder / STATE_FILE)


def expected_resume(checkpoint) -> "tuple[Optional[int], Optional[dict]]":
    """(iteration, SNIP state) of the checkpoint Bridge will load from `checkpoint.load`, before
    the model exists; (None, None) for a fresh run (nothing to load, or `finetune`, which restarts
    the run from the weights). The state is None for a checkpoint written without SNIP."""
    load = getattr(checkpoint, "load", None)
    if not load or getattr(checkpoint, "finetune", False):
        return None, None
    if _is_iteration_dir(load):  # Bridge loads such a folder as it is
        state = read_state_file(Path(load) / STATE_FILE)
        return (int(state["iteration"]), state) if state is not None else (None, None)
    iteration = loaded_iteration_of(load, getattr(checkpoint, "ckpt_step", None))
    if not isinstance(iteration, int):  # nothing yet, or a release (converted) checkpoint
        return None, None
    return iteration, read_state_at(load, iteration)


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
