"""setup_megatron_lm: SNIP's one entrance into a Megatron-LM run (our entry point and the patch).

    model_cfg = gpt_config_from_args(args)
    setup_megatron_lm(args, model_cfg)          # SNIP: flags checked, controller, layer spec, seams
    pretrain(pretrain_cfg_container_from_args(args, model_cfg), ...)

Megatron builds the model from `model_cfg` with its own builder and layer spec; SNIP adds only its
linear classes (emulated backend) and each chunk's quant_recipe (model.py). A Megatron flag SNIP
cannot keep is refused here, by name, before anything starts (`check_run`: snip_megatron.support's
rules, read on the configs Megatron-LM builds from the arguments).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

from snip_megatron.config import SnipConfig
from snip_megatron.megatron.args import snip_config_from_args
from snip_megatron.models import gpt


def _print_rank_0(msg: str) -> None:
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, flush=True)


def resolve_backend(args) -> str:
    """--snip-backend, with auto resolved from --transformer-impl."""
    backend = getattr(args, "snip_backend", "auto")
    if backend == "auto":
        return "te" if args.transformer_impl == "transformer_engine" else "emulated"
    return backend


def moe_notice(inventory) -> "str | None":
    """The start-up line of an MoE model: the modules of its MoE layers that are never planned."""
    from snip_megatron.models import gpt

    kept = [u for u in inventory.unplanned if u in (gpt.MOE_ROUTER, gpt.SHARED_EXPERT_GATE)]
    if not kept:
        return None
    units = sum(1 for e in inventory if e.experts)
    return (f"[snip] MoE: {units} routed-expert units planned (each all experts of one layer's fc1 or fc2); "
            "never planned: " + "; ".join(f"{u.path} ({u.reason})" for u in kept))


@dataclass
class SnipRun:
    """SNIP inside one Megatron-LM process: its config, controller, and the step boundary."""

    config: SnipConfig
    """The --snip* flags."""
    controller: Any
    """The SnipController (or a stand-in with its hook methods, in tests)."""
    backend: str = "emulated"
    """Planned-linear backend: emulated or te."""
    sm: Optional[int] = None
    """The GPU's compute capability (TE backend): the TE dicts of every plan are this GPU's."""
    num_layers: Any = 0
    """The whole model's planned linears (an Inventory; a dense GPT's layer count also does)."""
    seq_length: int = 0
    micro_batch_size: int = 0
    user_recipe: Any = None
    """The user's own quant_recipe (--te-precision-config-file), merged after SNIP's matchers."""
    inventory: Any = None
    """The model's planned linears as the config gives them (models.inventory.Inventory); the built
    model is checked against it before the first step."""
    proof: Any = None
    """The run-time proof that Megatron's loop goes through SNIP's seams (pretrain.proof.RunProof)."""
    _started: bool = False
    _ctx: Any = field(default=None, repr=False)

    def step_begin(self, step: int, forward_step_func, model, optimizer, data_iterator,
                   num_microbatches: Optional[int] = None):
        """Before Megatron's train_step: the controller may measure on this step's micro-batches
        (which train_step then trains on) and apply a new plan. Returns what train_step must read."""
        from snip_megatron.pretrain.step import MegatronStep

        if self.proof is not None:
            self.proof.step_begins(step)

        ctx = MegatronStep(step=step - 1, chunks=list(model), optimizer=optimizer,
                           forward_step_func=forward_step_func, data_iterator=data_iterator,
                           num_microbatches=num_microbatches or _num_microbatches(),
                           seq_length=self.seq_length, micro_batch_size=self.micro_batch_size,
                           formats=self.config.formats, num_layers=self.num_layers, sm=self.sm,
                           inventory=self.inventory)
        if not self._started:
            self._started = True
            self.check_inventory(ctx.chunks)
            self.controller.on_train_start(ctx)
            self.check_applied(ctx.chunks)
        self.controller.on_step_start(ctx, step)
        self._ctx = ctx
        return ctx.data_iterator()

    def check_plan_runs(self, plan) -> None:
        """At start-up: the plan the model is built with has no precision this backend cannot run
        (a saved or resumed plan may hold one the planner would not choose)."""
        if self.backend != "te":
            return
        from snip_megatron.megatron.quant_recipe import check_runnable, config_dict_for

        configs = config_dict_for("te", sm=self.sm, formats=self.config.formats)
        check_runnable(plan, configs, backend="te", sm=self.sm, formats=self.config.formats)

    def check_inventory(self, chunks) -> None:
        """Before the first step, on every rank: the planned linears Megatron built on all ranks
        (one all-gather) are the ones the plan covers; else every rank exits with one line."""
        if self.inventory is None:
            return
        from snip_megatron.models.agree import agree_on_model

        try:
            agree_on_model(chunks, self.inventory)
        except ValueError as e:
            raise SystemExit(f"SNIP: {e}") from None

    def check_applied(self, chunks) -> None:
        """Before the first step: this rank's planned linears run the controller's plan."""
        from snip_megatron.megatron.apply import current_plan

        local, plan = current_plan(chunks), self.controller.plan
        wrong = [f"{k}: {local[k]} (plan: {plan[k]})" for k in local if local[k] is not plan[k]]
        if wrong or not len(local):
            raise RuntimeError("the model does not run the SNIP plan: "
                               + ("; ".join(wrong[:6]) if wrong else "no planned linears found"))
        _print_rank_0(f"[snip] rank 0 runs the plan on its {len(local)} planned linears: {local.counts()}")

    def step_end(self, step: int, loss) -> None:
        loss = float(loss) if loss is not None else None
        if self.config.loss_guard_factor > 0:
            loss = _loss_on_every_rank(loss)
        self.controller.on_step_end(self._ctx, step, {"loss": loss})

    def state_dict(self, iteration: int) -> dict:
        from snip_megatron.pretrain.state import STATE_VERSION

        return {"version": STATE_VERSION, "iteration": iteration, "snip_config": self.config.to_dict(),
                "plan_source": getattr(self.controller, "plan_source", None),
                "plan": self.controller.plan.to_dict(), "controller": self.controller.state_dict()}

    def resume(self, state: Optional[dict]) -> None:
        """Give the controller the state of the checkpoint Megatron loads (before the model exists)."""
        if state is not None:
            self.controller.load_state_dict(state["controller"])

    def saving(self, iteration: int) -> None:
        """SNIP's save wrapper, at a persistent save of `iteration` (every rank)."""
        if self.proof is not None:
            self.proof.saving(iteration)

    def report_saved(self, iteration: int, state: dict, save_dir: str) -> None:
        """Rank 0, once the checkpoint of `iteration` is final: SNIP's state beside it."""
        from snip_megatron.plan import Plan
        from snip_megatron.pretrain.state import write_state

        path = write_state(save_dir, iteration, state)
        print(f"[snip] saved plan ({Plan.from_dict(state['plan']).counts()}) to {path}", flush=True)
        if self.proof is not None:
            self.proof.state_written(iteration, save_dir)


def _num_microbatches() -> int:
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return get_num_microbatches()


def _loss_on_every_rank(loss):
    """The last pipeline stage's loss on every rank of its pipeline (one scalar all-reduce)."""
    import torch
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return loss
    t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
    torch.distributed.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
    return float(t.item())


def model_shape(args, transformer_config=None):
    """The ModelShape of Megatron's arguments (for the controller's FLOP table and TE's shape
    rules); the head width and MLP gating from the model's TransformerConfig when given."""
    from snip_megatron.shapes import ModelShape

    config = transformer_config
    return ModelShape(name="megatron", num_layers=args.num_layers, hidden_size=args.hidden_size,
                      ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                      num_query_groups=args.num_query_groups or args.num_attention_heads,
                      vocab_size=args.padded_vocab_size, seq_length=args.seq_length,
                      kv_channels=getattr(config, "kv_channels", None) or getattr(args, "kv_channels", None),
                      gated_linear_unit=bool(getattr(config, "gated_linear_unit", getattr(args, "swiglu", True))))


def expected_inventory(args, transformer_config=None, family: str = "gpt"):
    """The planned linears the run's config gives (models.inventory.Inventory), with the run's
    sequence_parallel setting: the GPT's (multi-latent attention and multi-token prediction
    included), or the HybridModel's of --hybrid-layer-pattern."""
    from snip_megatron.models import gpt, hybrid

    if family == gpt.FAMILY and transformer_config is not None:
        return gpt.of_config(transformer_config)
    shape = model_shape(args, transformer_config)
    sp = bool(getattr(transformer_config, "sequence_parallel", getattr(args, "sequence_parallel", False)))
    if family == hybrid.FAMILY:
        dims = hybrid.HybridDims.of(transformer_config if transformer_config is not None else args)
        moe = gpt.MoEDims.of(transformer_config) if transformer_config is not None else None
        return hybrid.inventory(shape, args.hybrid_layer_pattern, dims, moe=moe, sequence_parallel=sp)
    return gpt.inventory(shape, sequence_parallel=sp)


def te_shape_exclusions(snip: SnipConfig, args, transformer_config=None, inventory=None) -> dict:
    """The planned linears TE cannot run in FP8/FP4 on this layout (its shape rules), per precision
    (`inventory`: the model's planned linears, default the dense GPT's)."""
    from snip_megatron.te.shapes import te_exclusions

    if inventory is None and transformer_config is not None:
        inventory = gpt.of_config(transformer_config)
    return te_exclusions(model_shape(args, transformer_config), snip.formats, snip.uses, inventory=inventory,
                         tp=args.tensor_model_parallel_size,
                         sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                         cp=getattr(args, "context_parallel_size", 1) or 1, micro_batch_size=args.micro_batch_size)


MTP_FP4 = ("Megatron keeps FP4 off multi-token-prediction layers (transformer/multi_token_prediction.py, "
           "'currently ignoring FP4 in MTP layers')")


def mtp_exclusions(model, excluded: "dict | None" = None) -> "dict | None":
    """`excluded` with FP4 taken off every MTP linear, as Megatron does under a global FP4 (said once
    at start-up); the MTP linears are planned in the other precisions."""
    from snip_megatron.formats.precision import Precision

    mtp = [key for key in model.keys() if gpt.is_mtp(key)]
    if not mtp:
        return excluded
    _print_rank_0(f"[snip] {len(mtp)} multi-token-prediction linears planned in BF16/FP8, never FP4: {MTP_FP4}")
    out = dict(excluded or {})
    for key in mtp:
        out[key] = {**out.get(key, {}), Precision.FP4: MTP_FP4}
    return out


def make_controller(snip: SnipConfig, args, transformer_config, *, excluded=None, inventory=None):
    """SNIP's controller for this run, planning `inventory` (default the GPT the config describes):
    per-stage budgets from Megatron's own pipeline offsets; `excluded`, the precisions the backend
    cannot run per linear."""
    from snip_megatron.controller import SnipController
    from snip_megatron.megatron.layout import pipeline_stages
    from snip_megatron.models import hybrid

    stages = None
    if args.pipeline_model_parallel_size > 1:
        if inventory is not None and inventory.family == hybrid.FAMILY:
            stage_of = hybrid.stage_of_layers(args.hybrid_layer_pattern, args.pipeline_model_parallel_size)
            stages = {e.key: stage_of[e.layer] for e in inventory}
        else:
            stages = pipeline_stages(transformer_config)
    return SnipController(snip, model_shape(args, transformer_config), total_steps=args.train_iters,
                          run_dir=args.save,
                          tokens_per_step=args.global_batch_size * args.seq_length, stages=stages,
                          log=_print_rank_0, excluded=excluded, loggers=run_loggers(args),
                          inventory=gpt.of_config(transformer_config) if inventory is None else inventory)


def run_loggers(args):
    """Megatron-LM's own TensorBoard and W&B writers (`--tensorboard-dir`, `--wandb-project`), which
    Megatron creates on the last rank once `pretrain` has initialised."""
    from snip_megatron.loggers import RunLoggers, writers_of

    def writers():
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        return writers_of(tensorboard=get_tensorboard_writer(), wandb=get_wandb_writer())

    return RunLoggers(writers, enabled=bool(getattr(args, "tensorboard_dir", None)
                                            or getattr(args, "wandb_project", None)))


class CheckedRun(NamedTuple):
    """What the start-up checks settled."""

    config: SnipConfig
    """The --snip* flags, resolved for the backend and GPU (SnipConfig.resolved): its `formats` are
    what the planned linears run, its precisions and budget what the planner works with."""
    te: Any = None
    """The TE backend's start-up (snip_megatron.megatron.te_run.TERun: GPU, installed TE), else None."""

    @property
    def sm(self) -> Optional[int]:
        """The GPU's compute capability (TE backend), else None."""
        return None if self.te is None else self.te.sm


HEADS = {"megatron-lm": "this Megatron-LM run cannot take SNIP as configured",
         "analyze": "snip-analyze cannot measure this run as configured"}
"""The first words of a refusal, per entry."""


def check_run(args, family: str = "gpt", transformer_config=None, entry: str = "megatron-lm") -> Optional[CheckedRun]:
    """The run's resolved SnipConfig and, for the TE backend, the GPU's compute capability and the
    installed TE's own answers (None when SNIP is off), after refusing every Megatron setting it
    cannot honour (snip_megatron.support's rules, on the configs Megatron-LM builds from `args`;
    `transformer_config`: the model config's own, once built) and, on Transformer Engine, every
    format this GPU and this TE cannot run as SNIP would measure it; raises ValueError listing
    them all, each with its flag and fix."""
    import dataclasses

    from snip_megatron.megatron.args import named_as_flags
    from snip_megatron.pretrain.settings import settings_of
    from snip_megatron.support.check import refusal_message, refusals
    from snip_megatron.support.names import MegatronLMNames

    snip = snip_config_from_args(args)
    if not snip.enabled:
        return None
    config_file = getattr(args, "te_precision_config_file", None)
    if config_file and not Path(config_file).is_file():
        raise ValueError(f"--te-precision-config-file {config_file}: no such file (a YAML of matchers "
                         "and configs, as Megatron's load_quantization_recipe reads)")
    backend = resolve_backend(args)
    settings = settings_of(args, snip, backend, family, transformer_config, entry)
    names = MegatronLMNames()
    refused = refusals(settings, names)
    te = None
    if not refused:
        try:
            if backend == "te":
                from snip_megatron.megatron.te_run import resolve_for_te

                te = resolve_for_te(snip)
                snip = te.config
            else:
                snip = snip.resolved("emulated")
        except ValueError as e:
            refused.append(named_as_flags(str(e)))
        else:
            refused += refusals(dataclasses.replace(settings, snip=snip), names, resolved=True)
    if refused:
        raise ValueError(refusal_message(HEADS[entry], refused))
    return CheckedRun(snip, te)


def model_family(model_cfg) -> str:
    """The model family Megatron-LM's model config builds: a HybridModelConfig's (pretrain_hybrid.py),
    else the dense GPT's (pretrain_gpt.py's GPTModelConfig)."""
    import dataclasses

    from snip_megatron.models import gpt, hybrid

    fields = {f.name for f in dataclasses.fields(model_cfg)} if dataclasses.is_dataclass(model_cfg) else set()
    return hybrid.FAMILY if "hybrid_layer_pattern" in fields else gpt.FAMILY


def start(args, model_cfg, *, controller=None) -> Optional[SnipRun]:
    """setup_megatron_lm's work; raises ValueError naming what to change."""
    from snip_megatron.models import hybrid
    from snip_megatron.pretrain import seams
    from snip_megatron.pretrain.model import check_user_recipe, snip_hybrid_builder, snip_layer_spec
    from snip_megatron.pretrain.state import read_state

    family = model_family(model_cfg)
    transformer = getattr(model_cfg, "transformer", None)
    checked = check_run(args, family, transformer)
    if checked is None:
        return None
    snip, sm = checked.config, checked.sm
    backend = resolve_backend(args)
    user_recipe = transformer.quant_recipe
    inventory = expected_inventory(args, transformer, family)
    check_user_recipe(user_recipe, inventory, "--te-precision-config-file")
    excluded = te_shape_exclusions(snip, args, transformer, inventory) if backend == "te" else None
    excluded = mtp_exclusions(inventory, excluded)
    run = SnipRun(config=snip, controller=controller or make_controller(snip, args, transformer, excluded=excluded,
                                                                        inventory=inventory),
                  backend=backend, sm=sm, num_layers=inventory, seq_length=args.seq_length,
                  micro_batch_size=args.micro_batch_size, user_recipe=user_recipe, inventory=inventory)
    run.resume(read_state(args))
    run.check_plan_runs(run.controller.plan)
    if family == hybrid.FAMILY:
        # Megatron-LM builds the model through the config's builder (a ClassVar path): this run's
        # builder sets each chunk's quant_recipe before building it
        builder = snip_hybrid_builder(run, args.hybrid_layer_pattern)
        object.__setattr__(model_cfg, "get_builder_cls", lambda: builder)
    else:
        model_cfg.transformer_layer_spec = snip_layer_spec(run, model_cfg.transformer_layer_spec)
    seams.install(run)
    from snip_megatron.pretrain.proof import RunProof

    run.proof = RunProof(args.save, args.save_interval)
    run.proof.arm()  # the first training forward must come after SNIP's step hook
    plan = run.controller.plan
    _print_rank_0(f"[snip] on; backend {backend}; formats {snip.formats.short_str(snip.uses)}; plan: "
                  f"{getattr(run.controller, 'plan_source', '?')} {plan.counts()}")
    if backend == "te":
        from snip_megatron.megatron.te_run import startup_lines
        from snip_megatron.te.shapes import describe_exclusions, unfused_grouped_nvfp4

        for line in startup_lines(checked.te) + [f"[snip] {d}" for d in describe_exclusions(excluded)]:
            _print_rank_0(line)
        unfused = unfused_grouped_nvfp4(inventory, snip.uses, snip.fp4_recipe)
        if unfused is not None:
            _print_rank_0(f"[snip] {unfused}")
    notice = moe_notice(inventory)
    if notice is not None:
        _print_rank_0(notice)
    return run


def setup_megatron_lm(args, model_cfg, *, controller=None) -> Optional[SnipRun]:
    """SNIP inside a Megatron-LM run (patches/megatron-lm-pretrain_gpt.patch, and snip-pretrain-gpt).

    Call after `model_cfg = gpt_config_from_args(args)`, before `pretrain(...)`. Does nothing
    without --snip / --snip-plan / --snip-baseline. A setting SNIP cannot run exits with the reason."""
    from snip_megatron.megatron.args import named_as_flags

    script = "pretrain_hybrid.py" if model_family(model_cfg) == "hybrid" else "pretrain_gpt.py"
    try:
        return start(args, model_cfg, controller=controller)
    except ValueError as e:
        raise SystemExit(f"{script}: SNIP: {named_as_flags(str(e))}") from None
