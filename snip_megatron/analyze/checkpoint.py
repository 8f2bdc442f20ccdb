"""Which loop saved the checkpoint snip-analyze is given: the compact loop's, Megatron-LM's or
Megatron-Bridge's, told apart by the files each writes."""

from __future__ import annotations

from pathlib import Path

BRIDGE_RUN_CONFIG = "run_config.yaml"
"""Megatron-Bridge's run config, written into each of its iteration folders (and only by Bridge)."""


def which_loop(load: Path, step: "int | None") -> str:
    """'compact' (a folder of the compact loop: iter_* folders with its manifest), 'bridge'
    (Megatron's tracker and an iteration folder with Bridge's run config) or 'megatron-lm' (the
    tracker and iteration folder); ValueError naming --load otherwise."""
    from snip_megatron.pretrain.state import iteration_folder, loaded_iteration_of
    from snip_megatron.train.checkpoint import MANIFEST

    if not load.is_dir():
        raise ValueError(f"--load {load}: no such checkpoint folder")
    if any(load.glob(f"iter_*/{MANIFEST}")):
        return "compact"
    iteration = loaded_iteration_of(load, step)
    if iteration is None:
        raise ValueError(f"--load {load}: no checkpoint there (no latest_checkpointed_iteration.txt, no iter_* "
                         "folder of a finished save)")
    if iteration == "release":
        raise ValueError(f"--load {load}: a release checkpoint (converted weights, no training step or data "
                         "position); snip-analyze measures a checkpoint a training run saved: train one step from "
                         "it with --save, then analyze that")
    if not iteration_folder(load, iteration).is_dir():
        raise ValueError(f"--load {load}: no checkpoint of iteration {iteration} there "
                         f"({iteration_folder(load, iteration).name} is missing)")
    return "bridge" if (iteration_folder(load, iteration) / BRIDGE_RUN_CONFIG).is_file() else "megatron-lm"
