"""Train a model on real text with the compact Megatron-Core loop.

    python -m snip_megatron.train --model llama_tiny --steps 200 --metrics runs/tiny.jsonl
    torchrun --standalone --nproc_per_node 2 -m snip_megatron.train --model llama_tiny --tp 2 --steps 50

Prints a progress bar, then `RESULT first_val_loss=... final_val_loss=... tokens_per_s=...`.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from pathlib import Path

from snip_megatron.megatron.startup import quiet_startup; quiet_startup()  # before megatron.core loads
from snip_megatron.config import SnipConfig
from snip_megatron.controller import SnipController
from snip_megatron.data.prepare import DEFAULT_CACHE_DIR, DataConfig
from snip_megatron.megatron.args import add_snip_args, snip_config_from_args
from snip_megatron.shapes import get_shape
from snip_megatron.train.config import TrainConfig
from snip_megatron.train.loop import Trainer


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, SnipConfig, str | None]:
    p = argparse.ArgumentParser(prog="python -m snip_megatron.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="llama_tiny", help="model preset (snip_megatron.shapes)")
    a("--steps", type=int, default=100)
    a("--seq-length", type=int, default=None)
    a("--micro-batch-size", type=int, default=4)
    a("--global-batch-size", type=int, default=None)
    a("--lr", type=float, default=3e-3)
    a("--min-lr", type=float, default=3e-4)
    a("--warmup-steps", type=int, default=None)
    a("--lr-decay-style", default="cosine")
    a("--weight-decay", type=float, default=0.1)
    a("--clip-grad", type=float, default=1.0)
    a("--tp", type=int, default=1)
    a("--pp", type=int, default=1)
    a("--distributed-optimizer", action="store_true")
    a("--params-dtype", default="fp32", choices=("fp32", "bf16"))
    a("--backend", default="emulated", choices=("emulated", "local", "te"))
    a("--precision", default="bf16", help="initial precision of every planned linear: bf16, fp8, fp4")
    a("--seed", type=int, default=1234)
    a("--eval-interval", type=int, default=50)
    a("--eval-batches", type=int, default=8)
    a("--log-interval", type=int, default=1)
    a("--metrics", default=None, help="metrics JSONL path")
    a("--save-dir", default=None)
    a("--save-interval", type=int, default=None)
    a("--load-dir", default=None)
    a("--load-step", type=int, default=None)
    a("--no-progress", action="store_true")
    d = p.add_argument_group("data")
    d.add_argument("--corpus", default="stdlib")
    d.add_argument("--data-cache", default=DEFAULT_CACHE_DIR)
    d.add_argument("--vocab-size", type=int, default=None, help="default: the model's")
    d.add_argument("--tokenizer", default=None)
    d.add_argument("--max-docs", type=int, default=None)
    d.add_argument("--max-bytes", type=int, default=None)
    add_snip_args(p)
    p.add_argument("--run-dir", default=None,
                   help="folder for the SNIP plan log (snip_plans.jsonl) and the report; default: "
                        "beside --metrics")
    args = p.parse_args(argv)
    data = DataConfig(corpus=args.corpus, cache_dir=args.data_cache, tokenizer=args.tokenizer,
                      vocab_size=args.vocab_size or get_shape(args.model).vocab_size,
                      max_docs=args.max_docs, max_bytes=args.max_bytes)
    snip = snip_config_from_args(args)
    run_dir = args.run_dir or (str(Path(args.metrics).parent) if args.metrics else None)
    if snip.enabled and args.precision == "bf16":
        args.precision = snip.initial_precision  # the plan before SNIP's first measurement
    train = TrainConfig(
        model=args.model, data=data, steps=args.steps, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size, lr=args.lr,
        min_lr=args.min_lr, warmup_steps=args.warmup_steps, lr_decay_style=args.lr_decay_style,
        weight_decay=args.weight_decay, clip_grad=args.clip_grad, tp=args.tp, pp=args.pp,
        distributed_optimizer=args.distributed_optimizer, params_dtype=args.params_dtype,
        backend=args.backend, precision=args.precision, seed=args.seed,
        fp8_recipe=snip.fp8_recipe, fp4_recipe=snip.fp4_recipe,  # one flag sets both: the formats SNIP measures
        eval_interval=args.eval_interval or None, eval_batches=args.eval_batches,
        log_interval=args.log_interval, metrics_path=args.metrics, save_dir=args.save_dir,
        save_interval=args.save_interval, load_dir=args.load_dir, load_step=args.load_step,
        progress=not args.no_progress)
    return train, snip, run_dir


def main(argv: list[str] | None = None) -> int:
    config, snip, run_dir = parse_args(argv)
    hooks = []
    if snip.enabled:
        hooks.append(SnipController(snip, config.shape, total_steps=config.steps, run_dir=run_dir,
                                    tokens_per_step=config.micro_batch_size * config.seq_len))
    trainer = Trainer(config, hooks=hooks)
    history = trainer.fit()
    if trainer.is_reporter:
        vals = [m["val_loss"] for m in history if "val_loss" in m]
        speeds = [m["tokens_per_s"] for m in history if "tokens_per_s" in m]
        first = f"{vals[0]:.4f}" if vals else "nan"
        last = f"{vals[-1]:.4f}" if vals else "nan"
        tps = f"{statistics.median(speeds):.0f}" if speeds else "nan"
        print(f"RESULT first_val_loss={first} final_val_loss={last} tokens_per_s={tps} "
              f"steps={trainer.step}", flush=True)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
