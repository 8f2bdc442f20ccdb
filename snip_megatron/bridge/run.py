"""BridgeRun: one SNIP run inside Megatron-Bridge's pretrain(), and the process's active run.

Bridge builds the checkpoint manager from a class name and calls the layer spec and train_step
itself, so those three find their run here (`active`), by the ConfigContainer they belong to.
The step boundary is the Megatron-LM loop's own (`snip_megatron.pretrain.setup.SnipRun`: read-ahead
of the step's micro-batches, the controller's hooks, the loss on every pipeline rank); what is
Bridge's is when the controller is built (with the model, once Bridge finalised the config and
set up the process groups), which checkpoint's state it resumes, and when that state is saved.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from snip_megatron.config import SnipConfig

_ACTIVE: "Optional[BridgeRun]" = None


def _print_rank_0(msg: str) -> None:
    """Print on global rank 0 (torchrun's RANK before the process group exists)."""
    import os

    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))
    if rank == 0:
        print(msg, flush=True)


def activate(run: "BridgeRun") -> None:
    """Make `run` the process's SNIP run (enable_snip; one run per process at a time)."""
    global _ACTIVE
    _ACTIVE = run


def active(cfg=None) -> "Optional[BridgeRun]":
    """The active run; with `cfg` (a ConfigContainer, or its model config) only if it is that run's."""
    run = _ACTIVE
    if run is None or cfg is None:
        return run
    return run if cfg is run.cfg or cfg is run.cfg.model else None


def deactivate(run: "BridgeRun") -> None:
    global _ACTIVE
    if _ACTIVE is run:
        _ACTIVE = None


@dataclass
class BridgeRun:
    """SNIP inside one Bridge pretrain(): its settings, the controller (from the first chunk
    built), the resumed checkpoint's state and the states waiting for their checkpoint."""

    cfg: Any
    """Bridge's ConfigContainer."""
    snip: SnipConfig
    """SNIP's settings."""
    backend: str
    """Planned-linear backend: emulated or te."""
    user_spec: Any
    """The layer spec the config had (SnipLayerSpec builds it, with SNIP's linears put in)."""
    te: Any = None
    """The TE backend's start-up (snip_megatron.megatron.te_run.TERun: GPU, installed TE), else None."""
    user_recipe: Any = None
    """The config's own quant_recipe, merged after SNIP's matchers (modules SNIP does not plan)."""
    inner_manager: Optional[str] = None
    """The checkpoint manager class the config named (None: Bridge's default); SNIP's wraps it."""
    resumed: Optional[dict] = None
    """The SNIP state of the checkpoint Bridge is expected to load (read before the model is built)."""
    resumed_iteration: Optional[int] = None
    """Its iteration; None when nothing is resumed."""
    controller_factory: Any = None
    """Builds the controller from the final model config (tests pass a stand-in); default SNIP's."""
    loop: Any = None
    """The step boundary (snip_megatron.pretrain.setup.SnipRun), from the first chunk built."""
    state: Any = None
    """Bridge's GlobalState of the pretrain() running this run (set at on_train_start)."""
    pending_saves: deque = field(default_factory=deque)
    """(iteration, save dir, state) of each checkpoint saved and not yet final, oldest first."""

    # -- from the first model chunk Bridge builds -----------------------------------------------
    def start(self, model_config) -> None:
        """Once, before Bridge builds the first chunk: the final config checked again, the
        controller built and given the resumed state."""
        if self.loop is not None:
            return
        from snip_megatron.bridge.settings import check

        check(self.cfg, self.snip, self.backend)
        self.loop = self._make_loop(model_config, self.resumed)
        controller = self.loop.controller
        _print_rank_0(f"[snip] on; backend {self.backend}; formats {self.snip.formats.short_str(self.snip.uses)}; plan: "
                      f"{getattr(controller, 'plan_source', '?')} {controller.plan.counts()}")
        if self.te is not None:
            from snip_megatron.megatron.te_run import startup_lines

            for line in startup_lines(self.te):
                _print_rank_0(line)

    def _make_loop(self, model_config, state: Optional[dict]):
        from snip_megatron.pretrain.setup import SnipRun

        factory = self.controller_factory or make_controller
        # the built model is checked against this before the first step (SnipRun.check_inventory)
        inventory = planned_inventory(model_config)
        loop = SnipRun(config=self.snip, controller=factory(self.snip, model_config, self.cfg),
                       backend=self.backend, sm=None if self.te is None else self.te.sm,
                       num_layers=inventory,
                       seq_length=model_config.seq_length, micro_batch_size=self.cfg.train.micro_batch_size,
                       user_recipe=self.user_recipe, inventory=inventory)
        loop.resume(state)
        return loop

    @property
    def controller(self):
        if self.loop is None:
            raise RuntimeError("the SNIP controller exists once Bridge builds the model "
                               "(cfg.model.transformer_layer_spec must be enable_snip's SnipLayerSpec)")
        return self.loop.controller

    # -- Bridge loaded a checkpoint ---------------------------------------------------------------
    def after_load(self, iteration: Optional[int]) -> None:
        """Bridge loaded `iteration` (None: a fresh run, e.g. weights of a pretrained checkpoint).
        If that is not the checkpoint SNIP read before building the model, take the state of the
        one loaded: the controller is rebuilt with it and its plan applied before the first step."""
        if iteration == self.resumed_iteration:
            return
        from snip_megatron.bridge.state import read_state_at

        state = read_state_at(self.cfg.checkpoint.load, iteration) if iteration is not None else None
        _print_rank_0(f"[snip] Bridge loaded iteration {iteration}, not {self.resumed_iteration} as "
                      f"expected before the model was built: SNIP takes the state of iteration {iteration}"
                      + ("" if state is not None else " (none saved: the initial plan)"))
        self.resumed, self.resumed_iteration = state, iteration
        if self.loop is not None:
            self.loop = self._make_loop(self.cfg.model, state)

    # -- checkpoints --------------------------------------------------------------------------------
    def snapshot(self, iteration: int, save_dir: str) -> None:
        """A checkpoint of `iteration` is being saved (every rank): keep SNIP's state of now
        until Bridge says that checkpoint is final (`write_saved`)."""
        self.pending_saves.append((iteration, save_dir, self.loop.state_dict(iteration)))

    def write_saved(self) -> None:
        """The oldest checkpoint being saved is final: its SNIP state goes beside it (rank 0)."""
        if not self.pending_saves:
            return
        import torch

        iteration, save_dir, state = self.pending_saves.popleft()
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            self.loop.report_saved(iteration, state, save_dir)


def hybrid_pattern(model_config) -> "str | None":
    """The layer pattern of a HybridModelProvider (its deprecated override spelling included), else None."""
    from snip_megatron.bridge.settings import is_hybrid

    if not is_hybrid(model_config):
        return None
    return model_config.hybrid_layer_pattern or model_config.hybrid_override_pattern


def planned_inventory(model_config):
    """The planned linears of a Bridge model config (models.inventory.Inventory): a HybridModelProvider's
    of its layer pattern (its E layers' experts included), else the GPT's (multi-latent attention and
    multi-token prediction included)."""
    from snip_megatron.models import gpt, hybrid

    pattern = hybrid_pattern(model_config)
    if pattern is None:
        return gpt.of_config(model_config)
    sp = bool(model_config.sequence_parallel) and (model_config.tensor_model_parallel_size or 1) > 1
    return hybrid.inventory(model_shape(model_config), pattern, hybrid.HybridDims.of(model_config),
                            moe=gpt.MoEDims.of(model_config), sequence_parallel=sp)


def model_shape(model_config):
    """The ModelShape of Bridge's model config, for the controller's FLOP table (before Bridge
    finalises it, a HybridModelProvider's layers come from its pattern and the MLP width is
    Megatron's default, 4 x hidden)."""
    from snip_megatron.models import hybrid
    from snip_megatron.shapes import ModelShape

    pattern = hybrid_pattern(model_config)
    num_layers = model_config.num_layers or (len(hybrid.layer_symbols(pattern)) if pattern else None)
    return ModelShape(name="bridge", num_layers=num_layers, hidden_size=model_config.hidden_size,
                      ffn_hidden_size=model_config.ffn_hidden_size or 4 * model_config.hidden_size,
                      num_attention_heads=model_config.num_attention_heads,
                      num_query_groups=model_config.num_query_groups or model_config.num_attention_heads,
                      vocab_size=model_config.vocab_size, seq_length=model_config.seq_length,
                      kv_channels=getattr(model_config, "kv_channels", None),
                      gated_linear_unit=bool(getattr(model_config, "gated_linear_unit", True)))


def make_controller(snip: SnipConfig, model_config, cfg):
    """SNIP's controller for this run: per-stage budgets from Megatron's own pipeline offsets,
    the plan log in the checkpoint folder."""
    from snip_megatron.controller import SnipController
    from snip_megatron.megatron.layout import pipeline_stages
    from snip_megatron.models import hybrid
    from snip_megatron.pretrain.setup import moe_notice, mtp_exclusions

    inventory, pattern = planned_inventory(model_config), hybrid_pattern(model_config)
    pp = model_config.pipeline_model_parallel_size
    stages = None
    if pp > 1 and pattern is not None:  # the pattern's '|' segments (Megatron's select_pipeline_segment)
        stage_of = hybrid.stage_of_layers(pattern, pp)
        stages = {e.key: stage_of[e.layer] for e in inventory}
    elif pp > 1:
        stages = pipeline_stages(model_config)
    excluded = None
    if getattr(model_config, "transformer_impl", None) == "transformer_engine":
        from snip_megatron.te.shapes import describe_exclusions, te_exclusions

        excluded = te_exclusions(model_shape(model_config), snip.formats, snip.uses, inventory=inventory,
                                 tp=model_config.tensor_model_parallel_size,
                                 sequence_parallel=bool(model_config.sequence_parallel),
                                 cp=model_config.context_parallel_size or 1,
                                 micro_batch_size=cfg.train.micro_batch_size)
        for line in describe_exclusions(excluded):
            _print_rank_0(f"[snip] {line}")
    excluded = mtp_exclusions(inventory, excluded)  # Megatron keeps FP4 off MTP layers (said once)
    notice = moe_notice(inventory)  # an MoE model's router and shared-expert gate, never planned
    if notice is not None:
        _print_rank_0(notice)
    return SnipController(snip, model_shape(model_config), total_steps=cfg.train.train_iters,
                          run_dir=cfg.checkpoint.save,
                          tokens_per_step=cfg.train.global_batch_size * model_config.seq_length,
                          stages=stages, log=_print_rank_0, excluded=excluded, loggers=run_loggers(cfg),
                          inventory=inventory)


def run_loggers(cfg):
    """Bridge's own TensorBoard and W&B loggers (`logger.tensorboard_dir`, `logger.wandb_project`),
    which the GlobalState of the run's pretrain() creates on the last rank."""
    from snip_megatron.loggers import RunLoggers, writers_of

    def writers():
        run = active(cfg)
        if run is None or run.state is None:  # before on_train_start: no GlobalState yet
            return []
        return writers_of(tensorboard=run.state.tensorboard_logger, wandb=run.state.wandb_logger)

    return RunLoggers(writers, enabled=bool(cfg.logger.tensorboard_dir or cfg.logger.wandb_project))
