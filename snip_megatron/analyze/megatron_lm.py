"""A Megatron-LM checkpoint loaded and measured in Megatron-LM's own loop (snip-pretrain-gpt's, or
snip-pretrain-hybrid's where the run's flags give --hybrid-layer-pattern).

The run's own flags build the model, optimizer and data as its training did (Megatron's builder,
layer spec, `load_checkpoint`, data position); SNIP's layer spec puts its emulated linears in
(the checkpoint's parameters are the same). The plan is keyed by the model's inventory (a dense
GPT, multi-latent attention, multi-token prediction, MoE experts, a HybridModel's layers). A
stand-in for the controller measures the first step's micro-batches (the controller's
measurement: statistics pass and noise passes) and stops the loop before that step trains.
Nothing is saved: `--save`, the run's TensorBoard and W&B are switched off, and the scheduler is
taken from the flags (no step is taken; without --train-iters it ends one step after the
checkpoint's).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from snip_megatron.analyze.measured import Measurement, measured_count, said_before, uneven_split
from snip_megatron.formats.precision import Precision
from snip_megatron.plan import Plan

MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
              "num_query_groups", "kv_channels", "max_position_embeddings", "position_embedding_type",
              "normalization", "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights",
              "qk_layernorm", "num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
              "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "multi_latent_attention", "q_lora_rank",
              "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers",
              "hybrid_layer_pattern", "vocab_size")
"""Megatron-LM arguments that fix the model's parameters: a checkpoint of other values is another model."""
_FLAG = {"add_bias_linear": "--disable-bias-linear"}


def flag(arg: str) -> str:
    return _FLAG.get(arg, "--" + arg.replace("_", "-"))


class Measured(Exception):  # noqa: N818 - control flow: the measurement is taken, the loop stops
    """Raised on every rank at the first step, after the measurement."""

    def __init__(self, stats, chunks, step: int, seconds: float, num_microbatches: int):
        super().__init__("measured")
        self.stats, self.chunks, self.step, self.seconds = stats, chunks, step, seconds
        self.num_microbatches = num_microbatches


class MeasureOnce:
    """The controller's part in SnipRun (pretrain.setup): the model runs BF16, the first step is
    measured, and the loop stops there."""

    name = "snip"

    def __init__(self, snip, inventory):
        """`inventory`: the model's planned linears (an Inventory; a dense GPT's layer count also does)."""
        self.config = snip
        self.plan = Plan.uniform(inventory, Precision.BF16)
        self.plan_source = "snip-analyze"

    def load_state_dict(self, state) -> None:
        """The checkpoint's SNIP state: not needed, the measurement is new."""

    def state_dict(self) -> dict:
        return {}

    def on_train_start(self, ctx) -> None:
        ctx.set_plan(self.plan)

    def on_step_start(self, ctx, step: int) -> None:
        from snip_megatron.stats import measure_step

        start = time.perf_counter()
        stats = measure_step(ctx, self.config.measure_config())
        raise Measured(stats, ctx.chunks, ctx.step, time.perf_counter() - start, len(ctx.current_batch))

    def on_step_end(self, ctx, step: int, metrics=None) -> None:
        """Never reached: the loop stops at the first step's start."""


def check_same_model(args, folder: Path) -> None:
    """ValueError naming the flags whose values differ from the run that wrote the checkpoint
    (read from its common state; a checkpoint without one is left to Megatron's own check)."""
    try:
        from megatron.core import dist_checkpointing

        saved = dist_checkpointing.load_common_state_dict(str(folder)).get("args")
    except Exception:  # not a torch_dist checkpoint: Megatron's check_checkpoint_args speaks
        return
    differ = [f"{flag(a)} {_model_value(saved, a)!r} there, {_model_value(args, a)!r} here" for a in MODEL_ARGS
              if hasattr(saved, a) and hasattr(args, a) and _model_value(saved, a) != _model_value(args, a)]
    if differ:
        raise ValueError(f"--load {args.load}: the checkpoint holds another model ({'; '.join(differ)}); "
                         "give the run's own model flags")


def _model_value(args, name: str):
    """The value of a model argument as the model reads it: without --group-query-attention every
    head is its own group (Megatron-LM's FLOP count writes that into the saved arguments); a hybrid
    pattern's '|' cuts are the pipeline layout, not the model (its layers are compared)."""
    if name == "hybrid_layer_pattern" and getattr(args, name, None):
        from snip_megatron.models import hybrid

        return hybrid.layer_symbols(args.hybrid_layer_pattern)
    if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
        return args.num_attention_heads
    return getattr(args, name)


def _for_analysis(args, k: int, loaded: int) -> None:
    """SNIP on and measuring (no saved plan, no pinning, no baseline), K micro-batches; nothing saved
    or logged; the loop reaches one more step (a finished run's, or one without --train-iters)."""
    args.snip, args.snip_plan, args.snip_pin_plan, args.snip_baseline = True, None, False, None
    args.snip_measure_micro_batches = k
    args.save, args.async_save, args.tensorboard_dir, args.wandb_project = None, False, None, None
    args.override_opt_param_scheduler, args.use_checkpoint_opt_param_scheduler = True, False
    if args.train_samples is None and (args.train_iters is None or args.train_iters <= loaded):
        args.train_iters = loaded + 1


def family_of(args) -> str:
    """The model family the run's flags build: a HybridModel with --hybrid-layer-pattern
    (snip-pretrain-hybrid, pretrain_hybrid.py), else a GPT (snip-pretrain-gpt, pretrain_gpt.py)."""
    from snip_megatron.models import gpt, hybrid

    return hybrid.FAMILY if getattr(args, "hybrid_layer_pattern", None) else gpt.FAMILY


def measure(argv: list, load: Path, ckpt_step: "int | None", k: int) -> "Measurement | None":
    """Load the checkpoint with the run's flags (`argv`) and measure K micro-batches (every rank);
    None after --help."""
    from snip_megatron.pretrain.entry import model_config, parse_megatron_args
    from snip_megatron.pretrain.setup import check_run, expected_inventory
    from snip_megatron.pretrain.state import iteration_folder, loaded_iteration

    argv = [*argv, "--load", str(load), "--snip"] + (["--ckpt-step", str(ckpt_step)] if ckpt_step is not None else [])
    args = parse_megatron_args(argv, prog="snip-analyze")
    if args is None:
        return None
    loaded = loaded_iteration(args)
    if loaded is None:  # --finetune: Megatron would load the weights as step 0 of a new run
        raise ValueError("--finetune: snip-analyze measures the checkpoint at its own step; drop --finetune")
    check_same_model(args, iteration_folder(load, loaded))
    _for_analysis(args, k, 0 if loaded == "release" else int(loaded))
    family = family_of(args)
    checked = check_run(args, family, entry="analyze")
    model_cfg = model_config(args, family)
    inventory = expected_inventory(args, model_cfg.transformer, family)
    taken = _measure_first_step(args, MeasureOnce(checked.config, inventory), family, model_cfg)
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    transformer = get_model_config(taken.chunks[0])
    excluded = _exclusions(checked, args, transformer, inventory)
    return Measurement(
        stats=taken.stats, snip=checked.config, step=taken.step, seconds=taken.seconds,
        controller_for=lambda config: _controller(config, args, transformer, excluded, inventory),
        measured=measured_count(taken.num_microbatches, ps.get_data_parallel_world_size(), k),
        pp=args.pipeline_model_parallel_size, vpp=args.virtual_pipeline_model_parallel_size, sm=checked.sm,
        layout_error=_uneven_split(args), pattern=getattr(args, "hybrid_layer_pattern", None))


def _measure_first_step(args, controller: MeasureOnce, family: str, model_cfg) -> Measured:
    """Megatron-LM's `pretrain` up to its first step, where `controller` measures and stops it."""
    from snip_megatron.pretrain.entry import run_pretrain

    try:
        run_pretrain(args, controller=controller, family=family, model_cfg=model_cfg)
    except Measured as m:
        return m
    except AssertionError as e:  # Megatron's check_checkpoint_args, for checkpoints it reads itself
        found = re.match(r"(\w+) value from checkpoint \((.*)\) is not equal to the input argument value \((.*)\)",
                         str(e))
        if found is None:
            raise
        raise ValueError(f"--load {args.load}: the checkpoint holds another model ({flag(found[1])} {found[2]} "
                         f"there, {found[3]} here); give the run's own model flags") from None
    raise RuntimeError("Megatron-LM's loop ended before its first step: nothing was measured")


def _exclusions(checked, args, transformer, inventory) -> "dict | None":
    """The precisions the run's controller would never plan per linear: TE's shape rules (TE
    backend) and FP4 on multi-token-prediction linears (as Megatron)."""
    from snip_megatron.pretrain.setup import mtp_exclusions, te_shape_exclusions

    excluded = te_shape_exclusions(checked.config, args, transformer, inventory) if checked.sm is not None else None
    return said_before(mtp_exclusions, inventory, excluded)


def _controller(config, args, transformer, excluded, inventory):
    from snip_megatron.pretrain.setup import make_controller

    return make_controller(config, args, transformer, excluded=excluded, inventory=inventory)


def _uneven_split(args) -> "str | None":
    names = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
    return uneven_split({flag(n): getattr(args, n, None) for n in names}, pin="--snip-plan")
