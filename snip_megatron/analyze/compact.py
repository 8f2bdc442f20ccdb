"""A compact-loop checkpoint (snip-train, `python -m snip_megatron.train`) loaded and measured.

The loop's own flags build the Trainer as the run's did; it loads the checkpoint (any layout:
dist_checkpointing reshards) and its data position; the measurement runs on the next step's
micro-batches. Nothing is saved, logged or trained.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from snip_megatron.analyze.measured import Measurement, measured_count


def check_same_model(trainer, folder: Path, load: Path) -> None:
    """ValueError naming the first parameter whose shape in the checkpoint is not this model's, and
    the flags that set the shapes (dist_checkpointing would read a slice of a larger tensor
    without a word)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = dist_checkpointing.load_tensors_metadata(str(folder))
    for module in trainer.modules:
        for ours in nested_values(module.sharded_state_dict()):
            theirs = saved.get(ours.key) if isinstance(ours, ShardedTensor) else None
            if theirs is None or tuple(theirs.global_shape) == tuple(ours.global_shape):
                continue
            raise ValueError(f"--load {load}: the checkpoint holds another model ({ours.key} is "
                             f"{list(theirs.global_shape)} there, {list(ours.global_shape)} here with --model "
                             f"{trainer.config.shape.name} --vocab-size {trainer.shape.vocab_size}); give the "
                             "run's own model and data flags")


def measure(argv: list, load: Path, step: "int | None", k: int) -> Measurement:
    """Load the checkpoint with the loop's flags (`argv`) and measure K micro-batches (every rank)."""
    from snip_megatron.controller import SnipController
    from snip_megatron.stats import measure_step
    from snip_megatron.train import checkpoint
    from snip_megatron.train.__main__ import parse_args
    from snip_megatron.train.loop import Trainer

    loaded = int(checkpoint.verify(load, step).name[5:])  # CheckpointError names what is missing
    config, snip, _ = parse_args([*argv, "--snip", "--snip-measure-micro-batches", str(k)])
    snip = dataclasses.replace(snip, plan=None, pin_plan=False, baseline=None)
    config = dataclasses.replace(config, load_dir=None, load_step=None, save_dir=None, metrics_path=None,
                                 tensorboard_dir=None, progress=False, eval_interval=None,
                                 steps=max(config.steps, loaded + 1))
    trainer = Trainer(config)  # built as the run's, then loaded once its shapes are checked
    try:
        check_same_model(trainer, checkpoint.verify(load, loaded), load)
        trainer.load(load, loaded)
        trainer.current_batch = trainer.reader.take(trainer.num_microbatches)
        start = time.perf_counter()
        stats = measure_step(trainer, snip.measure_config())
        seconds = time.perf_counter() - start
    except BaseException:
        trainer.close()
        raise

    def controller_for(snip_config):  # the model's planned linears: a preset's MLA or MoE experts too
        return SnipController(snip_config, trainer.shape, total_steps=config.steps, log=lambda msg: None,
                              tokens_per_step=config.micro_batch_size * config.seq_len,
                              inventory=trainer.inventory)

    return Measurement(stats=stats, snip=snip, controller_for=controller_for, step=loaded,
                       measured=measured_count(trainer.num_microbatches, trainer.dp_size, k), seconds=seconds,
                       pp=config.pp, sm=None, close=trainer.close)
