"""Per-layer statistics and the two noise-injected passes, collected with hooks on a measurement step.

    from snip_megatron.stats import measure, MeasureConfig
    table = measure(model_chunks, forward_step_func, batches, seq_length=S, micro_batch_size=B,
                    optimizer=optimizer)                 # StatsTable, reduced, on global rank 0
    table = measure(trainer, config=snip_config)         # the same from a train.Trainer (controller)
"""

from __future__ import annotations

from snip_megatron.stats.config import MeasureConfig
from snip_megatron.stats.measure import measure, measure_config_from
from snip_megatron.stats.table import StatsTable

__all__ = ["MeasureConfig", "StatsTable", "measure", "measure_config_from"]
