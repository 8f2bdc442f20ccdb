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


def measure(argv: list, load: Path, step: "int | None", k: int) -> Measurement:
    """Load the checkpoint with the loop's flags (`argv`) and measure K micro-batches (every rank)."""
    from snip_megatron.controller import SnipController
    from snip_megatron.stats import measure_step
    from snip_megatron.train import checkpoint
    from snip_megatron.train.__main__ import parse_args
    from snip_megatron.train.loop import Trainer

    loaded = int(checkpoint.verify(load, step).name[5:])  # CheckpointError names what is missing
    config, snip, _, te = parse_args([*argv, "--snip", "--snip-measure-micro-batches", str(k)])
    snip = dataclasses.replace(snip, plan=None, pin_plan=False, baseline=None)
    config = dataclasses.replace(config, load_dir=str(load), load_step=loaded, save_dir=None, metrics_path=None,
                                 tensorboard_dir=None, progress=False, eval_interval=None,
                                 steps=max(config.steps, loaded + 1))
    try:
        trainer = Trainer(config)
    except checkpoint.CheckpointError as e:
        if "shape" not in str(e).lower() and "size mismatch" not in str(e).lower():
            raise
        first = str(e).splitlines()[0][:300]
        raise ValueError(f"--load {load}: the checkpoint holds another model than --model {config.shape.name} "
                         f"({first}); give the run's own --model") from None
    trainer.current_batch = trainer.reader.take(trainer.num_microbatches)
    start = time.perf_counter()
    stats = measure_step(trainer, snip.measure_config())
    seconds = time.perf_counter() - start
    excluded = None
    if te is not None:
        from snip_megatron.te.shapes import te_exclusions

        excluded = te_exclusions(config.shape, snip.formats, snip.uses, tp=config.tp,
                                 micro_batch_size=config.micro_batch_size)

    def controller_for(snip_config):
        return SnipController(snip_config, trainer.shape, total_steps=config.steps, log=lambda msg: None,
                              tokens_per_step=config.micro_batch_size * config.seq_len, excluded=excluded)

    return Measurement(stats=stats, snip=snip, controller_for=controller_for, step=loaded,
                       measured=measured_count(trainer.num_microbatches, trainer.dp_size, k), seconds=seconds,
                       pp=config.pp, sm=getattr(te, "sm", None), close=trainer.close)
