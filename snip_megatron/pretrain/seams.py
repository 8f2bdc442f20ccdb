"""Where SNIP joins megatron.training: the step boundary and the checkpoint save.

Megatron-LM offers no hook at a step boundary with the data iterator at hand, nor one after a
checkpoint is final, so SNIP wraps these functions, and only these, each checked against the
parameters this code was written for and against the caller that must look it up here
(`check_seams`, run before anything is wrapped, so a Megatron that changed one fails at start-up
with the function named, never mid-run; the table: snip_megatron/megatron/seams.py), and each
proven to run once the run is under way (snip_megatron.pretrain.proof):

- `training.train_step`: on every rank, before the step trains, the controller may measure on the
  step's own micro-batches (which train_step then trains on) and apply a new plan;
- `training.save_checkpoint`: SNIP's state at that iteration is written beside the checkpoint once
  it is final: after a synchronous save returns, or ...
- `checkpointing.schedule_async_save` (wrapped only during a save): ... as the last finalize step
  of an `--async-save` request, after Megatron's own (which writes the tracker file);
- `models.gpt.mtp_block_spec`: the multi-token-prediction block, which Megatron-LM builds from its
  own decoder spec, gets SNIP's planned linears as the decoder does (pretrain/model.py).
"""

from __future__ import annotations

from snip_megatron.megatron import seams as table

WRAPPED = table.wrapped("megatron-lm")
"""The functions SNIP wraps and the leading parameters it relies on (snip_megatron.megatron.seams)."""


def check_seams() -> None:
    """Raise RuntimeError naming every seam of Megatron-LM's loop (and Megatron-Core's) that no
    longer holds: a wrapped function whose parameters changed or that its caller no longer looks
    up where SNIP wraps it, a private method SNIP overrides with another signature
    (snip_megatron.megatron.seam_check)."""
    from snip_megatron.megatron.seam_check import check

    check("megatron-lm")


def _is_rank_0() -> bool:
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def install(run) -> None:
    """Wrap train_step and save_checkpoint for this process's SnipRun (setup.SnipRun)."""
    import functools

    from megatron.training import checkpointing as mcheckpointing
    from megatron.training import get_args
    from megatron.training import training as mtraining

    check_seams()
    original_step = mtraining.train_step
    original_save = mtraining.save_checkpoint
    from megatron.training.models import gpt as mgpt

    from snip_megatron.megatron import grouped_padding
    from snip_megatron.pretrain.model import with_planned_mtp_linears

    original_mtp = mgpt.mtp_block_spec

    @functools.wraps(original_mtp)
    def mtp_block_spec(config, transformer_layer_spec, *args, **kwargs):
        return with_planned_mtp_linears(original_mtp(config, transformer_layer_spec, *args, **kwargs), run.backend)

    mgpt.mtp_block_spec = mtp_block_spec

    @functools.wraps(original_step)
    def train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        iteration = kwargs.get("iteration")
        if iteration is None:
            iteration = get_args().curr_iteration
        step = iteration + 1
        # TE grouped experts: their token splits padded for each module's recipe (grouped_padding.py)
        grouped_padding.install(model)
        data_iterator = run.step_begin(step, forward_step_func, model, optimizer, data_iterator)
        # Gradient stochastic rounding: a stream per (layer, step), so a resumed run rounds alike.
        from snip_megatron.megatron.sr_seed import reseed_stochastic_rounding

        reseed_stochastic_rounding(model, step, get_args().seed)
        result = original_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        run.step_end(step, result[0].get("lm loss") if result[0] else None)
        return result

    @functools.wraps(original_save)
    def save_checkpoint(iteration, *args, **kwargs):
        margs = get_args()
        if not margs.save or kwargs.get("non_persistent_ckpt"):
            return original_save(iteration, *args, **kwargs)
        run.saving(iteration)
        state = run.state_dict(iteration)  # every rank: the controller may wait for its solver

        def write_after_checkpoint():
            if _is_rank_0():
                run.report_saved(iteration, state, margs.save)

        if not margs.async_save:
            result = original_save(iteration, *args, **kwargs)
            write_after_checkpoint()
            return result
        original_schedule = mcheckpointing.schedule_async_save
        added = []

        def schedule_async_save(async_request):
            # The request that carries Megatron's finalize steps (the tracker file) gets ours last.
            if not added and async_request.finalize_fns:
                async_request.add_finalize_fn(write_after_checkpoint)
                added.append(async_request)
            return original_schedule(async_request)

        mcheckpointing.schedule_async_save = schedule_async_save
        try:
            return original_save(iteration, *args, **kwargs)
        finally:
            mcheckpointing.schedule_async_save = original_schedule
            if not added and _is_rank_0():
                raise RuntimeError(f"--async-save: Megatron scheduled no finalize step for iteration "
                                   f"{iteration}, so SNIP cannot write its state after the checkpoint")

    mtraining.train_step = train_step
    mtraining.save_checkpoint = save_checkpoint
