"""A Megatron-Bridge checkpoint loaded and measured in Bridge's own set-up (snip-bridge-pretrain's).

The run's recipe and overrides (`--recipe MODULE:FUNCTION [--config-file YAML] [KEY=VALUE ...]`,
snip-bridge-pretrain's syntax, `snip.*` included) build Bridge's ConfigContainer, whose model is
compared with the checkpoint's own run config (`iter_<N>/run_config.yaml`) before anything starts.
enable_snip's pieces put SNIP's linears in (the checkpoint's parameters are the same), Bridge's
`setup()` builds the model, optimizer and data and loads the checkpoint's weights and data position
(not its optimizer state: no step is taken), and the controller's measurement runs on the next
step's micro-batches as the wrapped train_step would run it (a stand-in controller, the Megatron-LM
loop's `MeasureOnce`, stops there); Bridge's training loop never starts. Nothing is saved or logged:
`checkpoint.save`, the progress log and Bridge's loggers (TensorBoard, W&B, MLflow, Comet) are off.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snip_megatron.analyze.checkpoint import BRIDGE_RUN_CONFIG as RUN_CONFIG
from snip_megatron.analyze.measured import Measurement, measured_count, said_before, uneven_split

MODEL_FIELDS = (("model", "num_layers"), ("model", "hidden_size"), ("model", "ffn_hidden_size"),
                ("model", "num_attention_heads"), ("model", "num_query_groups"), ("model", "kv_channels"),
                ("model", "normalization"), ("model", "gated_linear_unit"), ("model", "add_bias_linear"),
                ("model", "add_qkv_bias"), ("model", "position_embedding_type"),
                ("model", "share_embeddings_and_output_weights"), ("model", "qk_layernorm"),
                ("model", "num_moe_experts"), ("model", "multi_latent_attention"), ("model", "vocab_size"),
                ("tokenizer", "vocab_size"))
"""Run-config fields that fix the model's parameters: a checkpoint of other values is another model."""
LOGGERS = ("tensorboard_dir", "wandb_project", "mlflow_experiment", "comet_project")
"""Bridge's logger settings, each of which creates its logger: all off."""


@dataclass
class BridgeAnalysis:
    """A Bridge run configured for analysis: nothing built yet."""

    cfg: Any
    """Bridge's ConfigContainer: the recipe and overrides, loading --load, saving and logging nothing."""
    snip: Any
    """SNIP's settings (the run's `snip.*`), measuring K micro-batches, no saved plan or baseline."""
    forward_step: Any


def check_same_model(cfg, folder: Path, load: Path) -> None:
    """ValueError naming the run-config fields whose values differ from the run that wrote the
    checkpoint (fields the recipe leaves unset until Bridge finalises it are not compared)."""
    import yaml

    try:
        saved = yaml.safe_load((folder / RUN_CONFIG).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--load {load}: {folder.name}/{RUN_CONFIG} cannot be read ({e})") from None
    differ = []
    for section, name in MODEL_FIELDS:
        theirs = (saved.get(section) or {}).get(name)
        ours = getattr(getattr(cfg, section, None), name, None)
        if theirs is not None and ours is not None and theirs != ours:
            differ.append(f"{section}.{name} {theirs!r} there, {ours!r} here")
    if differ:
        raise ValueError(f"--load {load}: the checkpoint holds another model ({'; '.join(differ)}); give the "
                         "run's own recipe and overrides")


def for_analysis(cfg, load: Path, ckpt_step: "int | None", loaded: int) -> None:
    """Load --load at its step (weights, data position, RNG; not the optimizer state), save and log
    nothing, and let a finished run still reach one more step."""
    ckpt = cfg.checkpoint
    ckpt.load, ckpt.ckpt_step, ckpt.finetune, ckpt.load_optim = str(load), ckpt_step, False, False
    ckpt.save, ckpt.async_save, ckpt.pretrained_checkpoint = None, False, None
    for name in LOGGERS:
        if hasattr(cfg.logger, name):
            setattr(cfg.logger, name, None)
    cfg.logger.save_config_filepath, cfg.logger.log_progress = None, False
    if getattr(cfg, "ft", None) is not None:
        cfg.ft.enable_ft_package = False  # its state files go beside the checkpoints
    if cfg.train.train_iters is not None and cfg.train.train_iters <= loaded:
        cfg.train.train_iters = loaded + 1


def configure(recipe: str, argv: list, load: Path, ckpt_step: "int | None", k: int) -> BridgeAnalysis:
    """The run's ConfigContainer and SnipConfig from its recipe and overrides, checked against the
    checkpoint; ValueError (one line) when Bridge is missing, a setting is bad or the model differs."""
    from snip_megatron.bridge import cli
    from snip_megatron.pretrain.state import iteration_folder, loaded_iteration_of

    cli.require_bridge()
    from snip_megatron.megatron.startup import quiet_startup

    quiet_startup()  # one line per expected absence, before Bridge imports megatron.core
    cli.import_bridge()
    cfg, snip, forward_step = cli.configure(["--recipe", recipe, *argv])
    loaded = int(loaded_iteration_of(load, ckpt_step))  # which_loop found its iteration folder
    check_same_model(cfg, iteration_folder(load, loaded), load)
    for_analysis(cfg, load, ckpt_step, loaded)
    snip = dataclasses.replace(snip, enabled=True, plan=None, pin_plan=False, baseline=None,
                               measure_micro_batches=k)
    return BridgeAnalysis(cfg=cfg, snip=snip, forward_step=forward_step)


def measure(a: BridgeAnalysis, k: int) -> Measurement:
    """Build and load the run with Bridge's setup() and measure K micro-batches (every rank)."""
    import torch.distributed as dist
    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.setup import setup
    from megatron.bridge.training.state import GlobalState

    from snip_megatron.analyze.megatron_lm import MeasureOnce
    from snip_megatron.bridge.enable import install, prepare_run
    from snip_megatron.bridge.run import deactivate, hybrid_pattern, make_controller, planned_inventory

    cfg = a.cfg
    run = prepare_run(cfg, a.snip)  # the Bridge settings that fight a plan are refused here
    run.controller_factory = lambda snip, model_config, _cfg: MeasureOnce(snip, planned_inventory(model_config))
    install(cfg, run)
    owns_group = not dist.is_initialized()

    def close() -> None:
        from megatron.bridge.training.initialize import destroy_global_state

        from snip_megatron.bridge import seams

        seams.uninstall()
        deactivate(run)
        destroy_global_state()
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()

    try:
        runtime_config_update(cfg)
        state = GlobalState()
        state.cfg = cfg
        built = setup(state, get_dataset_provider(cfg.dataset))
        run.state = built.state
        taken = _measure_next_step(run, built, a.forward_step)
    except BaseException:
        close()
        raise
    from megatron.core import parallel_state as ps

    model = cfg.model
    return Measurement(
        stats=taken.stats, snip=run.snip, step=taken.step, seconds=taken.seconds,
        controller_for=lambda config: said_before(make_controller, config, model, cfg),
        measured=measured_count(taken.num_microbatches, ps.get_data_parallel_world_size(), k),
        pp=model.pipeline_model_parallel_size, vpp=model.virtual_pipeline_model_parallel_size,
        sm=None if run.te is None else run.te.sm, layout_error=_uneven_split(model), pattern=hybrid_pattern(model),
        close=close)


def _measure_next_step(run, built, forward_step):
    """What Bridge's train() does before its first train_step (model in training mode, the rerun
    machine at the loaded step, the forward step bound to the state, the forward pre-hook off as on
    a first iteration), then SNIP's step boundary, whose stand-in controller measures and stops."""
    from megatron.bridge.training.train import disable_forward_pre_hook, should_disable_forward_pre_hook
    from megatron.bridge.training.utils.train_utils import prepare_forward_step_func
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.core.utils import get_model_config

    from snip_megatron.analyze.megatron_lm import Measured

    state, model, cfg = built.state, built.model, built.state.cfg
    for chunk in model:
        chunk.train()
    get_rerun_state_machine().current_iteration = state.train_state.step
    if should_disable_forward_pre_hook(cfg.ddp.use_megatron_fsdp, cfg.optimizer.use_distributed_optimizer,
                                       cfg.ddp.overlap_param_gather):
        disable_forward_pre_hook(model, param_sync=False)
        get_model_config(model[0]).param_sync_func = None
    forward = prepare_forward_step_func(forward_step, state)
    start = time.perf_counter()
    try:
        run.loop.step_begin(state.train_state.step + 1, forward, model, built.optimizer, built.train_data_iterator)
    except Measured as m:
        return m
    raise RuntimeError(f"no measurement after {time.perf_counter() - start:.1f} s: SNIP's step boundary "
                       "returned without measuring")


def _uneven_split(model) -> "str | None":
    names = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
    return uneven_split({f"model.{n}": getattr(model, n, None) for n in names}, pin="snip.plan")
