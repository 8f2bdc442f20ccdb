"""The compact training loop: Megatron-Core's schedule, DDP, optimizer and LR scheduler, nothing else.

    trainer = Trainer(TrainConfig(model="llama_tiny", steps=200, metrics_path="runs/m.jsonl"))
    history = trainer.fit()

The Trainer is itself the StepContext its hooks see (snip_megatron.hooks): `chunks` (DDP-wrapped
model chunks), `optimizer`, `forward_step_func`, `current_batch` (this step's micro-batches),
`seq_length`, `micro_batch_size`, `formats`, `step` and `set_plan()` (apply a precision plan at a
step boundary). Beyond it: `modules` (the GPTModel chunks inside DDP) and `forward_backward()` (an
extra pass on the current batch that leaves gradients in `param.main_grad` and does not step the
optimizer). `figure_writers()`: the loop's TensorBoard writer (`tensorboard_dir`, on the rank that
logs), for SNIP's figures (snip_megatron.loggers).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from snip_megatron.data.gpt import BatchReader, build_splits
from snip_megatron.data.prepare import prepare
from snip_megatron.formats.precision import Precision
from snip_megatron.megatron import runtime
from snip_megatron.megatron.sr_seed import reseed_stochastic_rounding
from snip_megatron.plan import Plan
from snip_megatron.train import checkpoint
from snip_megatron.train.config import TrainConfig
from snip_megatron.hooks import StepHook, check_unique_names, hooks_from_json, hooks_to_json

LOSS_KEY = "lm loss"
TENSORBOARD_METRICS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s")
"""Metrics the loop writes to its TensorBoard folder, as train/<name>."""


class Trainer:
    """Sets up parallel state, data, model, optimizer and scheduler on construction (every rank)."""

    def __init__(self, config: TrainConfig, hooks: Sequence[StepHook] = ()):
        self.config = config
        self.hooks = list(hooks)
        check_unique_names(self.hooks)
        self.step = 0
        """Optimizer steps completed."""
        self._resharding = False
        self.consumed_train_samples = 0
        self.current_batch: list[dict] | None = None
        self.history: list[dict] = []
        self._setup_parallel()
        self.tensorboard = self._tensorboard_writer()
        """A SummaryWriter on the reporting rank when `tensorboard_dir` is set, else None."""
        self._setup_data()
        self._setup_model()
        self.inventory = self._agreed_inventory()
        """The planned linears of the model on every rank, checked against the config's."""
        self.set_plan(Plan.uniform(self.inventory, config.precision))
        if config.load_dir is not None:
            self.load(config.load_dir, config.load_step)

    @property
    def seq_length(self) -> int:
        """Tokens per sample (the same attribute Megatron-LM's step adapter exposes to the controller)."""
        return self.config.seq_len

    @property
    def micro_batch_size(self) -> int:
        return self.config.micro_batch_size

    @property
    def formats(self):
        """The FP8/FP4 formats the planned linears run."""
        return self.config.formats

    # ---- setup -------------------------------------------------------------------------------

    def _setup_parallel(self) -> None:
        from megatron.core import parallel_state as ps

        cfg = self.config
        self.rank, self.world_size = runtime.init_process_group()
        cfg.check_support(self.world_size)  # what the compact loop runs depends on its processes too
        runtime.initialize_model_parallel(tp=cfg.tp, pp=cfg.pp, seed=cfg.seed)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        per_step = cfg.micro_batch_size * self.dp_size
        self.global_batch_size = cfg.global_batch_size or per_step
        if self.global_batch_size % per_step:
            raise ValueError(f"TrainConfig.global_batch_size={self.global_batch_size} is not a multiple of "
                             f"micro_batch_size x data-parallel size = {cfg.micro_batch_size} x {self.dp_size}")
        self.num_microbatches = self.global_batch_size // per_step
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        # One rank writes logs and metrics: the last pipeline stage holds the loss.
        self.is_reporter = (self.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
                            and self.dp_rank == 0)

    def _tensorboard_writer(self):
        cfg = self.config
        if cfg.tensorboard_dir is None:
            return None
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:  # checked on every rank: all stop together
            raise ValueError(f"TrainConfig.tensorboard_dir={cfg.tensorboard_dir!r} needs the tensorboard "
                             "package: pip install tensorboard (or drop --tensorboard-dir)")
        if not self.is_reporter:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(cfg.tensorboard_dir)

    def figure_writers(self) -> list:
        """This rank's writers for SNIP's figures (snip_megatron.loggers.RunLoggers.writers)."""
        from snip_megatron.loggers import writers_of

        return writers_of(tensorboard=self.tensorboard)

    def _setup_data(self) -> None:
        cfg = self.config
        data_config = cfg.data_config
        # Rank 0 tokenizes; the others then find everything in the cache.
        if self.rank == 0:
            self.data = prepare(data_config, progress=cfg.progress)
        _barrier()
        if self.rank != 0:
            self.data = prepare(data_config)
        self.shape = cfg.shape.with_(vocab_size=self.data.vocab_size)
        self.splits = build_splits(self.data, seq_length=cfg.seq_len,
                                   train_samples=cfg.steps * self.global_batch_size, seed=cfg.seed,
                                   split=cfg.split)
        self.reader = BatchReader(self.splits.train, micro_batch_size=cfg.micro_batch_size,
                                  dp_rank=self.dp_rank, dp_size=self.dp_size)

    def _setup_model(self) -> None:
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from snip_megatron.megatron.batch import make_forward_step
        from snip_megatron.megatron.model import build_model_chunks

        cfg = self.config
        runtime.seed_all(cfg.seed)
        dtype = torch.bfloat16 if cfg.params_dtype == "bf16" else torch.float32
        experts = cfg.moe.config_fields() if cfg.moe is not None else {}
        self.modules = build_model_chunks(self.shape, backend=cfg.backend, params_dtype=dtype, mla=cfg.mla, **experts)
        model_config = self.modules[0].config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=cfg.distributed_optimizer)
        self.chunks = [DistributedDataParallel(config=model_config, ddp_config=ddp_config, module=m,
                                               disable_bucketing=i > 0)
                       for i, m in enumerate(self.modules)]
        model_config.finalize_model_grads_func = finalize_model_grads
        model_config.no_sync_func = self.chunks[0].no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, clip_grad=cfg.clip_grad,
                            bf16=model_config.bf16, fp16=False, params_dtype=dtype,
                            use_distributed_optimizer=cfg.distributed_optimizer),
            self.chunks)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
            lr_warmup_steps=cfg.num_warmup_steps, lr_decay_steps=cfg.steps,
            lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
            wd_incr_steps=cfg.steps, wd_incr_style="constant")
        self.forward_backward_func = get_forward_backward_func()
        self.forward_step_func = make_forward_step(LOSS_KEY)

    def _agreed_inventory(self):
        """The model's planned linears as every rank built them (one all-gather), checked against
        the config's (its sequence_parallel included) and against each hook's own (a controller
        planning another model); ValueError, one line, the same on every rank."""
        from snip_megatron.models import gpt
        from snip_megatron.models.agree import agree_on_model

        sp = bool(getattr(self.modules[0].config, "sequence_parallel", False))
        inventory = agree_on_model(self.modules, gpt.inventory(self.shape, sequence_parallel=sp, mla=self.config.mla,
                                                                moe=self.config.moe))
        for hook in self.hooks:
            planned = getattr(hook, "inventory", None)
            if planned is not None:
                planned.check_same(inventory, what=f"the model the loop built (hook {hook.name!r} plans another)")
        return inventory

    # ---- precision ---------------------------------------------------------------------------

    def set_plan(self, plan: Plan) -> None:
        """Run every planned linear of this rank at the precision `plan` gives it (a step boundary).

        Collective in spirit: call it on every rank at the same step. A plan that does not fit the
        model is refused (ValueError) before any module changes.
        """
        from snip_megatron.megatron.apply import apply_plan

        if not isinstance(plan, Plan):
            raise ValueError(f"set_plan needs a Plan, got {type(plan).__name__}")
        plan.check_model(self.inventory)
        if self.config.backend == "local":  # plain Megatron linears: BF16 (or the params dtype) only
            if any(p is not Precision.BF16 for p in plan.values()):
                raise ValueError("backend 'local' runs plain Megatron linears and cannot take FP8/FP4 "
                                 "plans; use backend='emulated'")
        else:
            apply_plan(self.chunks, plan, num_layers=self.inventory, formats=self.config.formats)
        self.plan = plan

    # ---- one step ----------------------------------------------------------------------------

    def forward_backward(self, batches: list[dict] | None = None, *, forward_only: bool = False) -> float:
        """Forward (and backward) over `batches` (default: the current step's) without an optimizer
        step. Gradients are left in the DDP buffers (`param.main_grad`), zeroed first. Returns the
        mean loss, the same on every rank."""
        batches = self.current_batch if batches is None else batches
        if not batches:
            raise ValueError("forward_backward: no batches (call it inside a step or pass batches)")
        if not forward_only:
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
        reduced = self.forward_backward_func(
            forward_step_func=self.forward_step_func, data_iterator=iter(batches), model=self.chunks,
            num_microbatches=len(batches), seq_length=self.config.seq_len,
            micro_batch_size=self.config.micro_batch_size, forward_only=forward_only)
        return self._mean_loss(reduced)

    def _mean_loss(self, reduced: list[dict]) -> float:
        """Mean over micro-batches and DP ranks, from the last pipeline stage to every rank."""
        from megatron.core import parallel_state as ps

        local = (sum(float(r[LOSS_KEY]) for r in reduced) / len(reduced)) if self.is_last_stage else 0.0
        t = torch.tensor([local], dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(t, group=ps.get_data_parallel_group())
            t /= self.dp_size
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())  # other stages add 0
        return float(t.item())

    def train_step(self) -> dict:
        """One optimizer step on the next global batch; returns its metrics (hooks run around it)."""
        step = self.step + 1
        self.current_batch = self.reader.take(self.num_microbatches)
        for hook in self.hooks:
            hook.on_step_start(self, step)
        # Gradient stochastic rounding: a stream per (layer, step), so a resumed run rounds alike.
        reseed_stochastic_rounding(self.chunks, step, self.config.seed)
        start = time.perf_counter()
        loss = self.forward_backward()
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        elapsed = time.perf_counter() - start
        self.step = step
        self.consumed_train_samples += self.global_batch_size
        tokens = self.global_batch_size * self.config.seq_len
        metrics = {"step": step, "loss": loss, "lr": self.scheduler.get_lr(self.optimizer.param_groups[0]),
                   "grad_norm": float(grad_norm) if grad_norm is not None else None,
                   "skipped": not ok, "step_time_s": elapsed, "tokens_per_s": tokens / elapsed,
                   "consumed_samples": self.consumed_train_samples}
        cfg = self.config
        if cfg.eval_interval and (step % cfg.eval_interval == 0 or step == cfg.steps):
            metrics["val_loss"] = self.evaluate()
        for hook in self.hooks:
            hook.on_step_end(self, step, metrics)
        self.current_batch = None
        return metrics

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss on the first `eval_batches` micro-batches of the held-out split (same every time)."""
        reader = BatchReader(self.splits.valid, micro_batch_size=self.config.micro_batch_size,
                             dp_rank=self.dp_rank, dp_size=self.dp_size)
        batches = reader.take(self.config.eval_batches)
        for chunk in self.chunks:
            chunk.eval()
        try:
            return self.forward_backward(batches, forward_only=True)
        finally:
            for chunk in self.chunks:
                chunk.train()

    # ---- the run -----------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        """Train until config.steps; validation, metrics, progress and checkpoints as configured."""
        cfg = self.config
        for hook in self.hooks:
            hook.on_train_start(self)
        if cfg.eval_interval and self.step == 0:
            self._log({"step": 0, "val_loss": self.evaluate(), "consumed_samples": 0})
        bar = tqdm(total=cfg.steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not (cfg.progress and self.is_reporter))
        while self.step < cfg.steps:
            metrics = self.train_step()
            if self.step % cfg.log_interval == 0 or "val_loss" in metrics or self.step == cfg.steps:
                self._log(metrics)
            postfix = {"loss": f"{metrics['loss']:.3f}", "tok/s": f"{metrics['tokens_per_s']:.0f}"}
            if "val_loss" in metrics:
                postfix["val"] = f"{metrics['val_loss']:.3f}"
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            if cfg.save_dir and ((cfg.save_interval and self.step % cfg.save_interval == 0)
                                 or self.step == cfg.steps):
                self.save(cfg.save_dir)
        bar.close()
        return self.history

    def _log(self, metrics: dict) -> None:
        self.history.append(metrics)
        if self.is_reporter and self.config.metrics_path:
            path = Path(self.config.metrics_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps({k: _json_num(v) for k, v in metrics.items()}) + "\n")
        if self.tensorboard is not None:
            for name in TENSORBOARD_METRICS:
                value = metrics.get(name)
                if value is not None:
                    self.tensorboard.add_scalar(f"train/{name}", float(value), metrics["step"])

    # ---- checkpoints -------------------------------------------------------------------------

    def sharded_state_dict(self, *, is_loading: bool = False) -> dict:
        """Model, optimizer, scheduler, data position, plan, hook state and RNG, for dist_checkpointing."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        # The GPTModels inside DDP: the same keys as Megatron-LM checkpoints ("model", "model0", ...).
        if len(self.modules) == 1:
            state = {"model": self.modules[0].sharded_state_dict()}
        else:
            state = {f"model{i}": m.sharded_state_dict() for i, m in enumerate(self.modules)}
        # The distributed optimizer's own DP-sharded layout (Megatron-LM's default): no gather.
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"} if self.config.distributed_optimizer else None
        if is_loading and self.config.distributed_optimizer:
            init_adam_state(self.optimizer)
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
        state["scheduler"] = self.scheduler.state_dict()
        state["trainer"] = {
            "step": self.step,
            "consumed_train_samples": self.consumed_train_samples,
            "global_batch_size": self.global_batch_size,
            "plan": json.dumps({str(k): p.value for k, p in self.plan.items()}),
            "world_size": self.world_size,
            # Rank 0's hook state, for a resume on another layout (where per-rank state cannot map).
            "hooks": hooks_to_json(self.hooks),
        }
        # Per rank (hooks may keep rank-local state, RNG streams differ by TP rank): one shard each.
        if not (is_loading and self._resharding):
            per_rank = {"rng": checkpoint.rng_state(), "hooks": hooks_to_json(self.hooks)}
            state["rank_state"] = ShardedObject("rank_state", per_rank, (self.world_size,), (self.rank,),
                                                replica_id=0)
        return state

    def save(self, root: "str | Path") -> Path:
        """Checkpoint the current step under `root` (collective)."""
        return checkpoint.save(root, self.step, self.sharded_state_dict())

    def load(self, root: "str | Path", step: int | None = None) -> int:
        """Resume from a checkpoint (latest when step is None); returns its step. Collective."""
        saved_world = checkpoint.saved_world_size(root, step)
        # Another world size (a new TP/PP/DP layout): weights, optimizer and scheduler reshard;
        # per-rank RNG streams cannot map, so they restart from the seed (said, not silent).
        self._resharding = saved_world is not None and saved_world != self.world_size
        step, state = checkpoint.load(root, step, self.sharded_state_dict(is_loading=True))
        trainer_state = state["trainer"]
        if trainer_state["global_batch_size"] != self.global_batch_size:
            raise checkpoint.CheckpointError(
                f"checkpoint step {step} used global_batch_size={trainer_state['global_batch_size']}, "
                f"this run {self.global_batch_size}: the data position would not match")
        for i, module in enumerate(self.modules):
            module.load_state_dict(state["model" if len(self.modules) == 1 else f"model{i}"], strict=True)
        with torch.no_grad():  # fp32 + distributed optimizer: main params are views of the weights
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(trainer_state["step"])
        self.consumed_train_samples = int(trainer_state["consumed_train_samples"])
        self.reader.consumed = self.consumed_train_samples
        self.set_plan(Plan(json.loads(trainer_state["plan"]).items()))
        if self._resharding:
            hooks_from_json(self.hooks, trainer_state["hooks"])
            if self.is_reporter:
                print(f"resuming step {step} on {self.world_size} ranks from a checkpoint of "
                      f"{saved_world}: RNG streams restart from the seed", flush=True)
        else:
            rank_state = state["rank_state"]
            hooks_from_json(self.hooks, rank_state["hooks"])
            checkpoint.set_rng_state(rank_state["rng"])
        return step

    def close(self) -> None:
        """Close the TensorBoard writer and tear down Megatron's parallel state (the process group
        stays for the caller)."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        runtime.destroy()


def init_adam_state(optimizer) -> None:
    """Give a fresh optimizer zero Adam state, as its first step would.

    Without TE/apex, Megatron's distributed optimizer reads Adam's 'step' out of existing state to
    build even the state dict that a checkpoint is loaded into, and fails on a fresh optimizer.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _json_num(v):
    # JSON has no NaN/Inf; write them as strings so every line stays valid JSON.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
