"""Whole-loop overhead of SNIP: training time with the controller against the same run without it.

Two processes run side by side (one thread each, so they share the machine's load alike): the
compact loop with a fixed plan of the same FP4 budget (the `random` baseline: no measurement, no
solver), and the same run (same model, data, steps, seed) with SNIP measuring every `interval`
steps. Both run 75% of the linear FLOPs in FP4 after the warm-up, so the emulation's own cost
(FP4 emulation is slower than FP8 on a CPU; on a GPU it is faster) does not count as overhead. The overhead is their wall-time difference over the plain run's time; the
time spent inside the controller's hooks (measurement, apply, waiting for the solver) is reported
beside it as an accounting cross-check. Used by bench/overhead.py; runs alone too:

    python bench/loop_overhead.py [--intervals 100,1000] [--steps 2000]

Last line: `RESULT loop_overhead_pct_100=<x> loop_overhead_pct_1000=<x>` (target: <= 1.0 at 1000).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _run(args: tuple) -> dict:
    snip_interval, steps, cache, seed = args
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from snip_megatron.config import SnipConfig
    from snip_megatron.controller import SnipController
    from snip_megatron.data.prepare import DataConfig
    from snip_megatron.shapes import ModelShape
    from snip_megatron.train.config import TrainConfig
    from snip_megatron.train.loop import Trainer

    shape = ModelShape(name="overhead", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                       num_attention_heads=4, num_query_groups=2, vocab_size=512, seq_length=64)
    train = TrainConfig(model=shape, steps=steps, micro_batch_size=2, eval_interval=None, progress=False,
                        precision="fp8", seed=seed,
                        data=DataConfig(corpus="stdlib", vocab_size=512, max_bytes=400_000, cache_dir=cache))
    hooks, hook_s = [], [0.0]
    interval = abs(snip_interval)
    fixed = {"baseline": "random"} if snip_interval < 0 else {}
    if snip_interval:
        snip = SnipConfig(enabled=True, fp4_budget=0.75, interval=interval, lag=min(10, interval - 1),
                          warmup=interval // 2, **fixed)

        class Timed(SnipController):
            def on_step_start(self, trainer, step):
                t = time.perf_counter()
                super().on_step_start(trainer, step)
                hook_s[0] += time.perf_counter() - t

            def on_step_end(self, trainer, step, metrics=None):
                t = time.perf_counter()
                super().on_step_end(trainer, step, metrics)
                hook_s[0] += time.perf_counter() - t

        hooks.append(Timed(snip, shape, total_steps=steps, log=lambda m: None,
                           tokens_per_step=2 * shape.seq_length))
    trainer = Trainer(train, hooks=hooks)
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    measurements = len([h for h in hooks[0].history if h.get("event") != "initial"])
    trainer.close()
    return {"interval": interval, "wall_s": wall, "hook_s": hook_s[0], "updates": measurements}


def loop_overhead(intervals=(100, 1000), steps: int = 2000, cache: str | None = None) -> dict[int, dict]:
    """{interval: figures} from side-by-side runs: a fixed plan of the same budget, and SNIP."""
    from snip_megatron.data.prepare import DataConfig, prepare

    cache = cache or str(ROOT / ".cache" / "snip-data")
    prepare(DataConfig(corpus="stdlib", vocab_size=512, max_bytes=400_000, cache_dir=cache))
    out = {}
    ctx = mp.get_context("spawn")
    for interval in intervals:
        with ctx.Pool(2, maxtasksperchild=1) as pool:
            # negative interval: the same schedule with the fixed-rule plan (the reference run)
            plain, snip = pool.map(_run, [(-interval, steps, cache, 0), (interval, steps, cache, 0)])
        out[interval] = {
            "plain_s": plain["wall_s"], "snip_s": snip["wall_s"], "hook_s": snip["hook_s"],
            "updates": snip["updates"],
            "overhead_pct": 100 * (snip["wall_s"] - plain["wall_s"]) / plain["wall_s"],
            "hook_pct": 100 * snip["hook_s"] / plain["wall_s"],
        }
    return out


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--intervals", default="100,1000")
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args(argv)
    intervals = [int(x) for x in args.intervals.split(",")]
    figures = loop_overhead(intervals, args.steps)
    print(f"{'interval':>9}{'fixed s':>10}{'SNIP s':>10}{'updates':>9}{'in hooks s':>12}"
          f"{'overhead %':>12}{'hooks %':>9}")
    for i, f in figures.items():
        print(f"{i:>9}{f['plain_s']:>10.1f}{f['snip_s']:>10.1f}{f['updates']:>9}{f['hook_s']:>12.2f}"
              f"{f['overhead_pct']:>12.2f}{f['hook_pct']:>9.2f}")
    line = "RESULT " + " ".join(f"loop_overhead_pct_{i}={f['overhead_pct']:.2f}" for i, f in figures.items())
    print(line)
    return line


if __name__ == "__main__":
    main()
