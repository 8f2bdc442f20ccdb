"""Checkpoints through `megatron.core.dist_checkpointing`, written so a failure never costs a good one.

Layout under a save folder (the same as Megatron-LM's, so its tools find the steps):

    latest_checkpointed_iteration.txt   the newest complete step
    iter_0000100/                       dist_checkpointing files + snip_manifest.json

A save goes to a hidden temporary folder; only when every rank has finished does rank 0 write the
manifest (every file and its size) and rename the folder into place, so a crash mid-save leaves
the previous checkpoints untouched, and saving the same step twice replaces it whole. A load checks
the manifest first and refuses a missing, incomplete or truncated checkpoint with CheckpointError
before touching the model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "snip_manifest.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, incomplete, truncated, or not ours)."""


def step_dir(root: "str | Path", step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def saved_steps(root: "str | Path") -> list[int]:
    """Steps with a complete checkpoint (a manifest) under `root`, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for d in root.glob("iter_*"):
        if (d / MANIFEST).is_file() and d.name[5:].isdigit():
            steps.append(int(d.name[5:]))
    return sorted(steps)


def latest_step(root: "str | Path") -> int | None:
    """The step named by the tracker file, else the newest complete checkpoint, else None."""
    tracker = Path(root) / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text.isdigit():
            return int(text)
    steps = saved_steps(root)
    return steps[-1] if steps else None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _without_psutil_ok() -> None:
    """Megatron's checkpoint writer processes call psutil only to log their memory use; without
    psutil each writer dies before reporting and the save waits forever. Report 0 bytes instead.
    (psutil belongs in the requirements; this keeps a lane without it from hanging.)"""
    try:
        import psutil  # noqa: F401
    except ImportError:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        filesystem_async._process_memory = lambda: 0


def save(root: "str | Path", step: int, sharded_state_dict: dict) -> Path:
    """Save on every rank (collective); returns the step's folder."""
    from megatron.core import dist_checkpointing

    _without_psutil_ok()

    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of this step
        tmp.mkdir()
    _barrier()
    dist_checkpointing.save(sharded_state_dict, str(tmp))
    _barrier()
    if _rank() == 0:
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
        _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
        # Replace, never merge: an older save of the same step moves aside until the new one is in.
        old = root / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _write_atomic(root / TRACKER, str(step))  # the newest save, as Megatron-LM does
    _barrier()
    return final


def verify(root: "str | Path", step: int | None = None) -> Path:
    """The folder of a complete checkpoint (latest when step is None); CheckpointError otherwise."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint to load: folder {root} does not exist")
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(f"no checkpoint to load in {root} (no {TRACKER}, no iter_* folder)")
    path = step_dir(root, step)
    if not path.is_dir():
        have = saved_steps(root)
        raise CheckpointError(f"no checkpoint for step {step} in {root}; saved steps: {have or 'none'}")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (the save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({e})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r}, expected {FORMAT_VERSION}")
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is truncated: {name} has {f.stat().st_size} bytes, "
                                  f"the manifest says {size}")
    return path


def load(root: "str | Path", step: int | None, sharded_state_dict: dict) -> tuple[int, dict]:
    """(step, loaded state dict) of a verified checkpoint; collective."""
    from megatron.core import dist_checkpointing

    path = verify(root, step)
    try:
        state = dist_checkpointing.load(sharded_state_dict, str(path))
    except Exception as e:  # dist_checkpointing raises many types; name the checkpoint
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(e).__name__}: {e}") from e
    return int(path.name[5:]), state


def saved_world_size(root: "str | Path", step: int | None) -> int | None:
    """The world size a verified checkpoint was written with (None for checkpoints that predate it)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(verify(root, step)))
    size = common.get("trainer", {}).get("world_size")
    return None if size is None else int(size)


def rng_state() -> dict:
    """This rank's RNG streams: torch's and Megatron's model-parallel tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
    return {"torch": torch.get_rng_state(), "tracker": tracker}


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
