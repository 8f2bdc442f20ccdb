"""Per-layer statistics and the noise-injected passes, collected with hooks on a measurement step.

    from snip_megatron.stats import measure_chunks, measure_step, MeasureConfig
    table = measure_chunks(model_chunks, forward_step_func, batches, seq_length=S, micro_batch_size=B,
                           optimizer=optimizer)          # StatsTable, reduced, on global rank 0
    table = measure_step(ctx, snip_config.measure_config())   # from a loop's StepContext (controller)
"""

from __future__ import annotations

from snip_megatron.stats.config import MeasureConfig
from snip_megatron.stats.measure import measure_chunks, measure_step
from snip_megatron.stats.table import StatsTable

__all__ = ["MeasureConfig", "StatsTable", "measure_chunks", "measure_step"]
