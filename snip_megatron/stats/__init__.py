"""Per-layer statistics and the two noise-injected passes, collected with hooks on a measurement step.

    from snip_megatron.stats import measure, MeasureConfig
    table = measure(model_chunks, forward_step_func, batches, seq_length=S, micro_batch_size=B,
                    optimizer=optimizer)                 # StatsTable, reduced, on global rank 0
    table = measure(trainer, config=snip_config)         # the same from a train.Trainer (controller)
"""

from __future__ import annotations

from snip_megatron.stats.config import MeasureConfig
from snip_megatron.stats.table import StatsTable

__all__ = ["MeasureConfig", "StatsTable", "measure", "measure_config_from"]


def measure_config_from(config) -> MeasureConfig:
    """A MeasureConfig from a MeasureConfig, None, or the controller's SnipConfig."""
    if config is None:
        return MeasureConfig()
    if isinstance(config, MeasureConfig):
        return config
    return MeasureConfig(noise_frac=getattr(config, "noise_scale", 0.05),
                         seed=getattr(config, "seed", 0),
                         fp8_recipe=getattr(config, "fp8_recipe", "blockwise"),
                         fp4_recipe=getattr(config, "fp4_recipe", "nvfp4"))


def measure(target, forward_step_func=None, batches=None, *, config=None, step=None, **kwargs):
    """Statistics of one step. `target` is a list of model chunks (then forward_step_func, batches,
    seq_length and micro_batch_size are required) or a train.Trainer (its chunks, optimizer and
    current_batch are used). Returns the reduced table on global rank 0 and None elsewhere for a
    Trainer; the table on the first pipeline stage for model chunks (see stats.measure.measure)."""
    from snip_megatron.stats.measure import measure as _measure

    mconfig = measure_config_from(config)
    if hasattr(target, "current_batch"):  # a Trainer
        import torch.distributed as dist

        from snip_megatron.megatron.batch import make_forward_step

        table = _measure(target.chunks, forward_step_func or make_forward_step(),
                         batches if batches is not None else target.current_batch,
                         seq_length=target.shape.seq_length,
                         micro_batch_size=target.config.micro_batch_size,
                         optimizer=target.optimizer, config=mconfig, **kwargs)
        return table if (not dist.is_initialized() or dist.get_rank() == 0) else None
    return _measure(target, forward_step_func, batches, config=mconfig, **kwargs)
