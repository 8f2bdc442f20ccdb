"""enable_snip: SNIP in a Megatron-Bridge pretrain() (the one call a user's script adds).

    pretrain(cfg, forward_step, callbacks=enable_snip(cfg, SnipConfig(enabled=True, fp4_budget=0.75)))

Everything a setting can break is checked here, before Bridge starts: the Bridge settings that
fight a plan (snip_megatron.support's rules, through bridge/settings.py), the SNIP settings against this run (the warm-up
against `train.train_iters`, a saved plan against the model, the config's own quant_recipe), and
the SNIP state of the checkpoint Bridge will resume, read before the model is built.
"""

from __future__ import annotations

import dataclasses

from snip_megatron.config import SnipConfig


def enable_snip(cfg, snip: SnipConfig) -> list:
    """Set `cfg` (a Bridge ConfigContainer) up for SNIP and return the callbacks for `pretrain`.

    Sets `cfg.model.transformer_layer_spec` (SNIP's linears and each chunk's quant_recipe from the
    plan) and `cfg.checkpoint.custom_manager_class` (SNIP's state with Bridge's checkpoints), and
    wraps Bridge's train_step (the measurement needs the step's data). Raises ValueError listing
    every setting to change. With `snip.enabled` false (and no `plan` or `baseline`, which switch
    it on) it changes nothing and returns [].
    """
    from megatron.bridge.training.config import ConfigContainer

    if not isinstance(cfg, ConfigContainer):
        raise ValueError(f"enable_snip needs Bridge's ConfigContainer, got {type(cfg).__name__}")
    if not isinstance(snip, SnipConfig):
        raise ValueError(f"enable_snip needs a SnipConfig, got {type(snip).__name__}")
    from snip_megatron.bridge.run import _print_rank_0

    if not snip.enabled and (snip.plan is not None or snip.baseline is not None):
        snip = dataclasses.replace(snip, enabled=True)  # asking for a plan is asking to run it
    if not snip.enabled:
        _print_rank_0("[snip] off (SnipConfig.enabled is false): Bridge trains the model as configured")
        return []
    run = prepare_run(cfg, snip)
    return install(cfg, run)


def prepare_run(cfg, snip: SnipConfig):
    """The BridgeRun of `cfg`, after every check; changes nothing (ValueError listing what to change)."""
    from snip_megatron.bridge.checkpoint import MANAGER
    from snip_megatron.bridge.model import SnipHybridStackSpec, SnipLayerSpec, spec_for_backend
    from snip_megatron.bridge.run import BridgeRun
    from snip_megatron.bridge.settings import backend_of, check, is_hybrid
    from snip_megatron.bridge.state import expected_resume
    from snip_megatron.controller import initial_plan
    from snip_megatron.plan import Plan
    from snip_megatron.pretrain.model import check_user_recipe

    model = cfg.model
    if isinstance(getattr(model, "transformer_layer_spec", None), SnipLayerSpec) or \
            isinstance(getattr(model, "hybrid_stack_spec", None), SnipHybridStackSpec):
        raise ValueError("enable_snip was already called on this config; call it once per ConfigContainer")
    backend = backend_of(model)
    check(cfg, snip, backend)
    te = None
    if backend == "te":  # what this GPU and its Transformer Engine run, checked before Bridge starts
        from snip_megatron.megatron.te_run import resolve_for_te

        te = resolve_for_te(snip)
        snip = te.config
    else:
        snip = snip.resolved("emulated")
    check(cfg, snip, backend, resolved=True)  # the formats this backend will run
    from snip_megatron.bridge.run import planned_inventory

    inventory = planned_inventory(model)  # the GPT's (MLA and MTP included), or the HybridModel's pattern
    try:
        snip.warmup_steps(cfg.train.train_iters)
    except ValueError as e:
        raise ValueError(f"{e} (Bridge's train.train_iters)") from None
    initial_plan(snip, inventory)  # a saved plan (snip.plan) must fit the model
    check_user_recipe(getattr(model, "quant_recipe", None), inventory, "model.quant_recipe")
    iteration, state = expected_resume(cfg.checkpoint)
    if state is not None:
        where = f"the SNIP state of checkpoint iteration {iteration} under {cfg.checkpoint.load}"
        try:
            Plan.from_dict(state["plan"]).check_model(inventory)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{where} does not fit this model ({e}); resume with the model it was "
                             "trained with") from None
    inner = cfg.checkpoint.custom_manager_class
    user_spec = (model.hybrid_stack_spec if is_hybrid(model) else
                 spec_for_backend(model.transformer_layer_spec, backend,
                                  bool(getattr(model, "multi_latent_attention", False))))
    return BridgeRun(cfg=cfg, snip=snip, backend=backend, te=te, user_spec=user_spec,
                     user_recipe=getattr(model, "quant_recipe", None),
                     inner_manager=None if inner == MANAGER else inner,
                     resumed=state, resumed_iteration=iteration)


def install(cfg, run) -> list:
    """Make `run` the active SNIP run of `cfg`: layer spec, checkpoint manager, train_step seam."""
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    from snip_megatron.bridge import seams
    from snip_megatron.bridge.callbacks import SnipCallback
    from snip_megatron.bridge.checkpoint import MANAGER
    from snip_megatron.bridge.model import SnipHybridStackSpec, SnipLayerSpec
    from snip_megatron.bridge.settings import is_hybrid
    from snip_megatron.bridge.run import activate

    seams.install()  # checks Bridge's train_step first: a changed Bridge stops here
    # Bridge instantiates the checkpoint manager (and any _target_ in a run_config.yaml) only from
    # allow-listed module prefixes.
    register_allowed_target_prefix("snip_megatron.")
    if is_hybrid(cfg.model):
        cfg.model.hybrid_stack_spec = SnipHybridStackSpec(run.user_spec)
    else:
        cfg.model.transformer_layer_spec = SnipLayerSpec(run.user_spec)
    cfg.checkpoint.custom_manager_class = MANAGER
    activate(run)
    return [SnipCallback(run)]
