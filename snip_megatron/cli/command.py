"""A RunRecipe as the exact command that runs it: Megatron-LM arguments, the training target, torchrun.

Pure functions of the recipe (no torch, no Megatron), so `snip-train --dry-run` is instant and the
launchers in `launch/` can ask for the target without importing the training stack.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import fields
from pathlib import PurePath

from snip_megatron.cli.recipe import RunRecipe
from snip_megatron.megatron.args import snip_args_from_config
from snip_megatron.shapes import PRESETS
from snip_megatron.models import gpt
from snip_megatron.train.config import TrainingSchedule

PRETRAIN_MODULE = "snip_megatron.pretrain"
COMPACT_MODULE = "snip_megatron.train"


def _num(v: float) -> str:
    """Short, exact decimal text for a float flag (3e-4, not 0.00030000000000000003)."""
    return repr(float(v)) if v != int(v) else str(int(v))


def megatron_args(recipe: RunRecipe) -> list[str]:
    """Megatron-LM / snip-pretrain-gpt arguments for the recipe (model, layout, data, schedule, SNIP)."""
    m, par, d, t = recipe.model, recipe.parallel, recipe.data, recipe.train
    args = [
        # Llama-like model.
        "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn_hidden_size),
        "--num-attention-heads", str(m.num_attention_heads),
    ]
    if m.num_query_groups != m.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    mla = gpt.PRESET_MLA.get(m.name)
    if mla is not None:  # the preset's multi-latent attention (llama_tiny_mla), with RoPE as the others'
        args += ["--multi-latent-attention", "--kv-lora-rank", str(mla.kv_lora_rank), "--qk-head-dim",
                 str(mla.qk_head_dim), "--qk-pos-emb-head-dim", str(mla.qk_pos_emb_head_dim), "--v-head-dim",
                 str(mla.v_head_dim), "--rope-type", "rope"]
        args += ["--q-lora-rank", str(mla.q_lora_rank)] if mla.q_lora_rank is not None else []
    moe = gpt.PRESET_MOE.get(m.name)
    if moe is not None:  # the preset's experts (llama_tiny_moe); SequentialMLP, as SNIP plans them
        args += ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.topk), "--moe-ffn-hidden-size",
                 str(moe.ffn_hidden_size), "--moe-layer-freq",
                 str(moe.layer_freq) if isinstance(moe.layer_freq, int) else str(list(moe.layer_freq))]
        args += (["--moe-shared-expert-intermediate-size", str(moe.shared_ffn_hidden_size)]
                 + (["--moe-shared-expert-gate"] if moe.shared_gate else [])) if moe.shared_ffn_hidden_size else []
    args += [
        "--seq-length", str(m.seq_length),
        "--max-position-embeddings", str(m.seq_length),
        "--position-embedding-type", "rope",
        "--normalization", "RMSNorm",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
        # Parallel layout.
        "--tensor-model-parallel-size", str(par.tp),
        "--pipeline-model-parallel-size", str(par.pp),
    ]
    if par.vpp is not None:
        args += ["--num-layers-per-virtual-pipeline-stage", str(m.num_layers // (par.pp * par.vpp))]
    if par.sequence_parallel:
        args.append("--sequence-parallel")
    if par.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif par.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    if par.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    args += ["--transformer-impl", t.transformer_impl]
    # Schedule: TrainingSchedule's fields under Megatron-LM's names.
    args += [
        "--micro-batch-size", str(t.micro_batch_size),
        "--global-batch-size", str(t.global_batch_size or t.micro_batch_size * par.data_parallel_size),
        "--train-iters", str(t.steps),
        "--lr", _num(t.lr),
        "--min-lr", _num(t.min_lr),
        "--lr-decay-style", t.lr_decay_style,
        "--lr-warmup-iters", str(t.num_warmup_steps),
        "--weight-decay", _num(t.weight_decay),
        "--adam-beta1", _num(t.adam_beta1),
        "--adam-beta2", _num(t.adam_beta2),
        "--clip-grad", _num(t.clip_grad),
        "--seed", str(t.seed),
    ]
    if t.params_dtype == "bf16":
        args.append("--bf16")
    # Data: Megatron's NullTokenizer carries the vocabulary size; the corpus tokenizer is ours.
    args += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab_size)]
    if d.kind == "mock":
        args.append("--mock-data")
    elif d.kind == "corpus":
        args += ["--corpus", d.corpus, "--corpus-cache", d.cache_dir, "--split", d.split]
        if d.tokenizer:
            args += ["--corpus-tokenizer", d.tokenizer]
    else:
        args += ["--data-path", d.path, "--corpus-tokenizer", d.tokenizer, "--split", d.split]
    # Bookkeeping.
    args += [
        "--log-interval", str(t.log_interval),
        "--eval-interval", str(t.eval_interval or t.steps),
        "--eval-iters", str(t.eval_batches if t.eval_interval else 0),
        "--save", t.run_dir,
        "--load", t.load or t.run_dir,
        "--save-interval", str(t.save_interval or t.steps),
    ]
    if t.tensorboard_dir:
        args += ["--tensorboard-dir", t.tensorboard_dir]
    if t.wandb_project:
        args += ["--wandb-project", t.wandb_project, "--wandb-exp-name", PurePath(t.run_dir).name]
    return args + snip_args_from_config(recipe.snip.snip_config())


def compact_args(recipe: RunRecipe) -> list[str]:
    """`python -m snip_megatron.train` arguments for the recipe (the compact Megatron-Core loop).

    The compact loop runs preset shapes on real text; what it cannot run is refused here with
    the field to change (or `train.entry=megatron`)."""
    m, par, d, t = recipe.model, recipe.parallel, recipe.data, recipe.train
    preset = PRESETS.get(m.name)
    if preset is None:
        raise ValueError(f"train.entry=compact runs the model presets ({', '.join(PRESETS)}); "
                         f"model.name={m.name!r} is not one: use train.entry=megatron")
    for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups"):
        if getattr(m, f) != getattr(preset, f):
            raise ValueError(f"train.entry=compact runs preset shapes: model.{f}={getattr(m, f)} differs "
                             f"from {m.name}'s {getattr(preset, f)}; use train.entry=megatron")
    if par.vpp is not None or par.sequence_parallel or par.recompute or t.transformer_impl != "local":
        raise ValueError("train.entry=compact has no virtual pipeline, sequence parallelism, recompute or "
                         "Transformer Engine spec: unset parallel.vpp / parallel.sequence_parallel / "
                         "parallel.recompute, set train.transformer_impl=local, or use train.entry=megatron")
    if d.kind == "mock":
        raise ValueError("train.entry=compact trains on real text: use data=stdlib (or data=indexed), "
                         "or train.entry=megatron for mock data")
    if t.wandb_project:
        raise ValueError("train.entry=compact writes TensorBoard only: unset train.wandb_project (use "
                         "train.tensorboard_dir), or use train.entry=megatron for W&B")
    args = ["--model", m.name, "--seq-length", str(m.seq_length), "--tp", str(par.tp), "--pp", str(par.pp)]
    # Schedule: the compact loop's flags are TrainingSchedule's fields under their own names.
    for f in fields(TrainingSchedule):
        value = getattr(t, f.name)
        if value is not None:
            args += ["--" + f.name.replace("_", "-"), _num(value) if isinstance(value, float) else str(value)]
    if par.distributed_optimizer:
        args.append("--distributed-optimizer")
    snip = recipe.snip.snip_config()
    args += ["--metrics", f"{t.run_dir}/metrics.jsonl", "--save-dir", t.run_dir]
    if t.tensorboard_dir:
        args += ["--tensorboard-dir", t.tensorboard_dir]
    if t.load:
        args += ["--load-dir", t.load]
    if d.kind == "corpus":
        args += ["--corpus", d.corpus, "--data-cache", d.cache_dir, "--vocab-size", str(m.vocab_size)]
    else:
        args += ["--corpus", d.path, "--data-cache", d.cache_dir]
    if d.tokenizer:
        args += ["--tokenizer", d.tokenizer]
    return args + snip_args_from_config(snip)


def training_target(recipe: RunRecipe) -> list[str]:
    """What follows `python` (one process) or torchrun's options: `-m <module> <args>`."""
    if recipe.entry == "compact":
        return ["-m", COMPACT_MODULE, *compact_args(recipe)]
    return ["-m", PRETRAIN_MODULE, *megatron_args(recipe)]


def torchrun_prefix(recipe: RunRecipe, *, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                    python: str | None = None) -> list[str]:
    """`python -m torch.distributed.run ...` for the recipe's nodes and processes.

    One node: `--standalone`. Several: c10d rendezvous at `rdzv_endpoint` (host:port) under
    `rdzv_id`; every node runs the same line (SLURM: one task per node).
    """
    par = recipe.parallel
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    if par.nnodes == 1:
        return cmd + ["--standalone", "--nnodes", "1", "--nproc-per-node", str(par.nproc_per_node)]
    if not rdzv_endpoint:
        raise ValueError(f"parallel.nnodes={par.nnodes} needs a rendezvous endpoint (host:port); "
                         "launch/slurm.sbatch sets it from the SLURM environment")
    return cmd + ["--nnodes", str(par.nnodes), "--nproc-per-node", str(par.nproc_per_node),
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                  "--rdzv-id", rdzv_id or "snip"]


def launch_command(recipe: RunRecipe, *, rdzv_endpoint: str | None = None,
                   rdzv_id: str | None = None, python: str | None = None) -> list[str]:
    """The whole command: plain `python -m ...` for one process, torchrun otherwise."""
    target = training_target(recipe)
    if recipe.parallel.world_size == 1:
        return [python or sys.executable, *target]
    return torchrun_prefix(recipe, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, python=python) + target


def shell_line(cmd: list[str]) -> str:
    """The command as one copy-pasteable shell line."""
    return " ".join(shlex.quote(c) for c in cmd)
