"""The Megatron-Bridge functions SNIP wraps: `megatron.bridge.training.train.train_step`, and
`megatron.bridge.models.gpt_provider.mtp_block_spec` (below).

Why: Bridge's callbacks (on_train_step_start and the rest) get the model and optimizer but no
data iterator, and a measurement runs on the micro-batches of the step about to train. So, on
every rank, before Bridge's train_step, the wrapper lets the controller read the step's
micro-batches ahead (train_step then trains on exactly those: `MegatronStep` replays them), measure
and apply a new plan, and it re-seeds the emulated linears' stochastic rounding for the step.
Bridge's `train()` looks `train_step` up in its module when it starts, so the wrapper is installed
there (by `enable_snip`, before pretrain) and passes through for any pretrain() that is not the
active SNIP run's. Its parameters are checked against the ones this code was written for
(`check_seams`, with the callers that must look them up here: snip_megatron/megatron/seams.py)
before anything is wrapped, so a Bridge that changed them fails at start-up with the function
named, never mid-run (tests/bridge/test_seams.py fails too).

`mtp_block_spec` (which GPTModelProvider.provide looks up in its module when it builds a chunk):
for the active SNIP run's model on the emulated backend, the multi-token-prediction block gets
Megatron's local norms and SNIP's emulated eh_proj (bridge/model.py `snip_mtp_block_spec`) instead
of Bridge's Transformer Engine ones; anything else passes through.
"""

from __future__ import annotations

import functools

from snip_megatron.megatron import seams as table

MODULE = "megatron.bridge.training.train"
PROVIDER = "megatron.bridge.models.gpt_provider"
WRAPPED = table.wrapped("bridge")
"""The wrapped functions and the leading parameters the wrappers rely on (Bridge 0.6.2;
snip_megatron.megatron.seams)."""

_ORIGINAL: dict = {}


def check_seams() -> None:
    """Raise RuntimeError naming every seam of Bridge's loop (and Megatron-Core's) that no longer
    holds: a wrapped function whose parameters changed, or that Bridge no longer looks up where SNIP
    wraps it (snip_megatron.megatron.seam_check)."""
    from snip_megatron.megatron.seam_check import check

    check("bridge")


def install() -> None:
    """Wrap Bridge's train_step and mtp_block_spec (once per process; pass-through for runs without SNIP)."""
    import importlib

    if _ORIGINAL:
        return
    check_seams()
    train = importlib.import_module(MODULE)
    original = train.train_step

    @functools.wraps(original)
    def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, global_state,
                   *args, **kwargs):
        data_iterator = step_begin(forward_step_func, data_iterator, model, optimizer, global_state)
        return original(forward_step_func, data_iterator, model, optimizer, scheduler, global_state,
                        *args, **kwargs)

    provider = importlib.import_module(PROVIDER)
    original_mtp = provider.mtp_block_spec

    @functools.wraps(original_mtp)
    def mtp_block_spec(config, vp_stage=None, *args, **kwargs):
        from snip_megatron.bridge.model import snip_mtp_block_spec
        from snip_megatron.bridge.run import active

        run = active(config)
        if run is None or run.backend != "emulated":
            return original_mtp(config, vp_stage, *args, **kwargs)
        return snip_mtp_block_spec(run, config, vp_stage)

    train.train_step = train_step
    provider.mtp_block_spec = mtp_block_spec
    _ORIGINAL.update({(MODULE, "train_step"): original, (PROVIDER, "mtp_block_spec"): original_mtp})


def uninstall() -> None:
    """Put Bridge's own functions back."""
    import importlib

    for (module, name), original in _ORIGINAL.items():
        setattr(importlib.import_module(module), name, original)
    _ORIGINAL.clear()


def step_begin(forward_step_func, data_iterator, model, optimizer, global_state):
    """The step boundary of the active SNIP run (if this pretrain() is it); returns what
    train_step must read this step."""
    from snip_megatron.bridge.run import active
    from snip_megatron.megatron import grouped_padding
    from snip_megatron.megatron.sr_seed import reseed_stochastic_rounding

    run = active(global_state.cfg)
    if run is None:
        return data_iterator
    if run.state is not global_state or run.loop is None:
        raise RuntimeError("this pretrain() runs a config enable_snip(cfg, snip) set up, but without "
                           "its callbacks or its layer spec: call pretrain(cfg, forward_step, "
                           "callbacks=enable_snip(cfg, snip)) and leave cfg.model.transformer_layer_spec as set")
    step = global_state.train_state.step + 1  # Bridge's step counts the steps completed
    # TE grouped experts: their token splits padded for each module's recipe (megatron/grouped_padding.py)
    grouped_padding.install(model)
    data_iterator = run.loop.step_begin(step, forward_step_func, model, optimizer, data_iterator)
    # Gradient stochastic rounding: a stream per (layer, step), so a resumed run rounds alike.
    reseed_stochastic_rounding(model, step, global_state.cfg.rng.seed)
    return data_iterator
