"""`make demo`: the quickstart. Tiny Llama-like pretraining with SNIP on CPU, on real text.

Trains `llama_tiny` (6 layers, 24 planned linears) on the running Python's standard library
sources with Megatron-Core's schedule and optimizer; every planned linear starts in FP8, SNIP
measures after a warm-up and re-plans periodically to put 75% of the linear FLOPs in FP4.
Prints a progress bar, the plan table at each update and the final validation loss, and writes
`metrics.jsonl`, `snip_plans.jsonl`, `snip_heatmap.png` and `loss.png` to the run folder.

    python -m snip_megatron.demo [--steps 300] [--run-dir runs/demo]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from snip_megatron.megatron.startup import quiet_startup

quiet_startup()  # before anything imports megatron.core: one line per expected absence

from snip_megatron.config import SnipConfig  # noqa: E402
from snip_megatron.controller import SnipController
from snip_megatron.data.prepare import DEFAULT_CACHE_DIR, DataConfig
from snip_megatron.report import make_report
from snip_megatron.train.config import TrainConfig
from snip_megatron.train.loop import Trainer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="SNIP quickstart: tiny Llama on CPU, real text")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--run-dir", default="runs/demo")
    parser.add_argument("--fp4-budget", type=float, default=0.75)
    parser.add_argument("--max-bytes", type=int, default=8_000_000,
                        help="bytes of the standard library to tokenize (the whole is ~30 MB)")
    args = parser.parse_args(argv)

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "snip_plans.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    train = TrainConfig(
        model="llama_tiny", steps=args.steps, micro_batch_size=8, lr=3e-3, min_lr=3e-4,
        precision="fp8", eval_interval=max(1, args.steps // 6), eval_batches=8,
        metrics_path=str(run_dir / "metrics.jsonl"),
        data=DataConfig(corpus="stdlib", cache_dir=DEFAULT_CACHE_DIR, max_bytes=args.max_bytes),
    )
    snip = SnipConfig(enabled=True, fp4_budget=args.fp4_budget, warmup=0.2,
                      interval=max(2, args.steps // 3), lag=2, initial_precision="fp8")

    start = time.perf_counter()
    controller = SnipController(snip, train.shape, total_steps=train.steps, run_dir=run_dir,
                                tokens_per_step=train.micro_batch_size * train.seq_len)
    trainer = Trainer(train, hooks=[controller])
    history = trainer.fit()
    vals = [m["val_loss"] for m in history if m.get("val_loss") is not None]
    if trainer.is_reporter:
        print(f"validation loss {vals[0]:.4f} -> {vals[-1]:.4f}; final plan: "
              f"{controller.plan.fp4_fraction(controller.flops):.1%} of linear FLOPs in FP4; "
              f"{time.perf_counter() - start:.0f} s")
        for name, path in make_report(run_dir).items():
            print(f"{name}: {path}")
    trainer.close()


if __name__ == "__main__":
    import sys

    from snip_megatron.errors import run_cli

    sys.exit(run_cli("python -m snip_megatron.demo", lambda argv: main(argv) or 0))
