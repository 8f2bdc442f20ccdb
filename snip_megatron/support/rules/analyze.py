"""Rules of snip-analyze: the layouts it measures a checkpoint at. An analysis takes one step's
micro-batches through the measurement; it runs at one process, TP (with SP on TE), PP and EP, which
is what a checkpoint needs to fit, and Megatron's torch_dist checkpoints load at another layout than
the one that saved them."""

from __future__ import annotations

from snip_megatron.support.rule import Rule


def _data_parallel(s) -> int:
    model = s.num("model.tensor_model_parallel_size") * s.num("model.pipeline_model_parallel_size")
    return s.run.world_size // max(1, model * s.num("model.context_parallel_size"))


def _unmeasured_layout(s):
    for path, holds in (("model.virtual_pipeline_model_parallel_size",
                         bool(s.get("model.virtual_pipeline_model_parallel_size"))),
                        ("model.context_parallel_size", s.num("model.context_parallel_size") > 1),
                        ("model.recompute_granularity", bool(s.get("model.recompute_granularity")))):
        if holds:
            return {"lead": path}
    return {"lead": "run.world_size"} if _data_parallel(s) > 1 else None


RULES = (
    Rule("analyze-layout", ("model.context_parallel_size", "model.virtual_pipeline_model_parallel_size",
                            "model.recompute_granularity", "run.world_size"), _unmeasured_layout,
         "{nx[lead]}: snip-analyze measures a checkpoint at one process, TP, PP and EP (no test runs it with "
         "virtual pipelining, context parallelism, recompute or data-parallel replicas)",
         "drop it, or use fewer processes: Megatron's torch_dist checkpoints load at another layout than the "
         "one that saved them", example={"model.context_parallel_size": 2, "model.transformer_impl": "transformer_engine",
                                         "run.backend": "te", "run.te_installed": True, "run.world_size": 2},
         entries=("analyze",)),
)
