"""A Megatron-LM checkpoint loaded and measured in Megatron-LM's own loop (snip-pretrain-gpt's).

The run's own flags build the model, optimizer and data as its training did (Megatron's builder,
layer spec, `load_checkpoint`, data position); SNIP's layer spec puts its emulated linears in
(the checkpoint's parameters are the same). A stand-in for the controller measures the first
step's micro-batches (the controller's measurement: statistics pass and noise passes) and stops
the loop before that step trains. Nothing is saved: `--save`, the run's TensorBoard and W&B are
switched off, and the scheduler is taken from the flags (no step is taken).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from snip_megatron.analyze.measured import Measurement, measured_count, uneven_split
from snip_megatron.formats.precision import Precision
from snip_megatron.plan import Plan

MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
              "num_query_groups", "kv_channels", "max_position_embeddings", "position_embedding_type",
              "normalization", "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights",
              "qk_layernorm", "num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
              "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "multi_latent_attention", "vocab_size")
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

    def __init__(self, snip, num_layers):
        """`num_layers`: the model's Inventory (or a dense GPT's layer count)."""
        self.config = snip
        self.plan = Plan.uniform(num_layers, Precision.BF16)
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
    differ = [f"{flag(a)} {getattr(saved, a)!r} there, {getattr(args, a)!r} here" for a in MODEL_ARGS
              if hasattr(saved, a) and hasattr(args, a) and getattr(saved, a) != getattr(args, a)]
    if differ:
        raise ValueError(f"--load {args.load}: the checkpoint holds another model ({'; '.join(differ)}); "
                         "give the run's own model flags")


def _for_analysis(args, k: int, loaded: int) -> None:
    """SNIP on and measuring (no saved plan, no pinning, no baseline), K micro-batches; nothing saved
    or logged; a finished run's loop still reaches one more step."""
    args.snip, args.snip_plan, args.snip_pin_plan, args.snip_baseline = True, None, False, None
    args.snip_measure_micro_batches = k
    args.save, args.async_save, args.tensorboard_dir, args.wandb_project = None, False, None, None
    args.override_opt_param_scheduler, args.use_checkpoint_opt_param_scheduler = True, False
    if args.train_iters is not None and args.train_iters <= loaded:
        args.train_iters = loaded + 1


def measure(argv: list, load: Path, ckpt_step: "int | None", k: int) -> "Measurement | None":
    """Load the checkpoint with the run's flags (`argv`) and measure K micro-batches (every rank);
    None after --help."""
    from snip_megatron.pretrain.entry import parse_megatron_args, run_pretrain
    from snip_megatron.pretrain.setup import check_run, make_controller, te_shape_exclusions
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
    checked = check_run(args)
    try:
        run_pretrain(args, controller=MeasureOnce(checked.config, args.num_layers))
    except Measured as m:
        taken = m
    except AssertionError as e:  # Megatron's check_checkpoint_args, for checkpoints it reads itself
        found = re.match(r"(\w+) value from checkpoint \((.*)\) is not equal to the input argument value \((.*)\)",
                         str(e))
        if found is None:
            raise
        raise ValueError(f"--load {load}: the checkpoint holds another model ({flag(found[1])} {found[2]} there, "
                         f"{found[3]} here); give the run's own model flags") from None
    else:
        raise RuntimeError("Megatron-LM's loop ended before its first step: nothing was measured")
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    transformer = get_model_config(taken.chunks[0])
    backend_te = checked.sm is not None
    excluded = te_shape_exclusions(checked.config, args, transformer) if backend_te else None
    return Measurement(
        stats=taken.stats, snip=checked.config, step=taken.step, seconds=taken.seconds,
        controller_for=lambda config: make_controller(config, args, transformer, excluded=excluded),
        measured=measured_count(taken.num_microbatches, ps.get_data_parallel_world_size(), k),
        pp=args.pipeline_model_parallel_size, vpp=args.virtual_pipeline_model_parallel_size, sm=checked.sm,
        layout_error=_uneven_split(args))


def _uneven_split(args) -> "str | None":
    names = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
    return uneven_split({flag(n): getattr(args, n, None) for n in names}, pin="--snip-plan")
