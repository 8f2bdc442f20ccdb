"""SNIP's state in Megatron-Bridge's checkpoints, read: the state file of an iteration, and the
state of the checkpoint Bridge will load, known before the model is built (the file format and
folders are the Megatron-LM loop's, snip_megatron.pretrain.state; bridge.checkpoint writes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from snip_megatron.pretrain.state import STATE_FILE, iteration_folder, loaded_iteration_of, read_state_file


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
