"""snip_state.json: SNIP's state beside each Megatron checkpoint, read for the iteration Megatron loads.

The file lives in the checkpoint's iteration folder (`<save>/iter_<N>/snip_state.json`) and is
written once that checkpoint is final (seams.py: after a synchronous save returns, or as the last
finalize step of an asynchronous one), so it never names a checkpoint that does not exist.
Plain JSON, never pickled. Megatron-Bridge writes the same folders and tracker, so its loop
(snip_megatron.bridge.checkpoint) keeps the same file with the same functions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

STATE_FILE = "snip_state.json"
STATE_VERSION = 1
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron's get_checkpoint_tracker_filename


def iteration_folder(root: "str | Path", iteration: "int | str") -> Path:
    """Megatron's folder of one checkpoint: `iter_0000042`, or `release`."""
    return Path(root) / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")


def loaded_iteration(args) -> "int | str | None":
    """The iteration Megatron will load: `--ckpt-step`, else the tracker of `--load`; None when
    nothing is loaded (no `--load`, no checkpoint there yet, or `--finetune`, which resets the run)."""
    return loaded_iteration_of(getattr(args, "load", None), getattr(args, "ckpt_step", None),
                               getattr(args, "finetune", False))


def loaded_iteration_of(load: "str | Path | None", ckpt_step: "int | None" = None,
                        finetune: bool = False) -> "int | str | None":
    """`loaded_iteration` from the three settings it reads (Megatron-LM's flags or Bridge's
    CheckpointConfig fields of the same names)."""
    if not load or finetune:
        return None
    if ckpt_step is not None:
        return int(ckpt_step)
    tracker = Path(load) / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        return "release"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{tracker}: Megatron's checkpoint tracker holds {text!r}, not an iteration "
                         "number; fix or remove it") from None


def read_state(args) -> Optional[dict]:
    """The SNIP state of the checkpoint Megatron loads, or None (nothing loaded, or a checkpoint
    written without SNIP). A corrupt or foreign file is refused, naming it."""
    iteration = loaded_iteration(args)
    if iteration is None:
        return None
    return read_state_file(iteration_folder(args.load, iteration) / STATE_FILE)


def read_state_file(path: "str | Path") -> Optional[dict]:
    """One snip_state.json, or None where the file is absent (a checkpoint written without SNIP).
    A corrupt or foreign file is refused, naming it."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the SNIP state of this checkpoint cannot be read ({e}); restore it "
                         f"from a copy, or delete it to resume with the initial plan") from None
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ValueError(f"{path}: not a SNIP state of version {STATE_VERSION} "
                         f"(found {state.get('version') if isinstance(state, dict) else type(state).__name__!r})")
    return state


def write_state(save_dir: "str | Path", iteration: int, state: dict) -> Path:
    """Write snip_state.json into the checkpoint folder of `iteration` (atomic rename)."""
    folder = iteration_folder(save_dir, iteration)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)
    return path
