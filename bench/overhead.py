"""What a SNIP measurement costs.

1. The default measurement (BF16 statistics pass + forward-noise pass + backward-noise pass, the
   controller's settings) on llama_tiny, in training-step equivalents: measurement wall time over
   the wall time of one training step on the same batch (a BF16 step, and a step of the
   controller's initial all-FP8 plan). Steps and measurements are interleaved and the median
   ratio is reported, so a busy machine slows both alike.
2. The CPU time of estimate + solve on the 70B layout (80 layers, 320 planned linears, PP=8
   per-stage budgets) with synthetic statistics: cost_table + solve_plan at a 75% FP4 budget.

3. The whole-loop overhead at intervals 100 and 1000: training with the SNIP controller against
   the same run without it, side by side (bench/loop_overhead.py), in percent of training time.

    python bench/overhead.py [--loop-steps 2000] [--no-loop]
Last line: RESULT measure_step_equiv=<x> cpu_s_70b=<x> loop_overhead_pct_100=<x> loop_overhead_pct_1000=<x>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def synthetic_stats(shape, tokens: int, seed: int = 0):
    """A statistics table with the 70B layout and plausible, layer-varying magnitudes."""
    from snip_megatron.models import gpt
    from snip_megatron.plan import all_keys
    from snip_megatron.stats.table import CANDIDATES, StatsTable, precision_field

    rng = np.random.default_rng(seed)
    keys = all_keys(shape.num_layers)
    t = StatsTable(keys=keys, globals_={"loss": 2.5, "num_microbatches": 1, "dp_size": 1})
    dims = gpt.linear_shapes(shape)
    for i, k in enumerate(keys):
        m, kk = dims[k.name]
        lognorm = lambda s=1.0: float(np.exp(rng.normal(0, s)))  # noqa: E731
        row = dict(x_sq=tokens * kk * lognorm(), w_sq=m * kk * 1e-4 * lognorm(), n=tokens, k=kk, m=m,
                   gy_sq=1e-6 * lognorm(), gx_sq=1e-6 * lognorm(), gw_sq=1e-5 * lognorm(),
                   y_sq=tokens * m * lognorm(), fwd_zg_clean=0.0, fwd_z_sq=tokens * m,
                   noise_scale=0.02, bwd_dgw_sq=1e-6 * lognorm(), bwd_eta_sq=1e-7 * lognorm(),
                   adam_du_sq=m * kk * lognorm(), adam_upd_sq=m * kk * 0.1 * lognorm(),
                   adam_numel=m * kk, present=1.0)
        row["fwd_zg_noisy"] = 0.02 * tokens * m * 1e-3 * lognorm(2.0)
        for f, v in row.items():
            t.set(k, f, v)
        for p, rel in zip(CANDIDATES, (1e-3, 3e-2)):
            for role, base in (("ex", "x_sq"), ("ex_w", "x_sq"), ("ew", "w_sq"), ("ew_d", "w_sq"),
                               ("egy_d", "gy_sq"), ("egy_w", "gy_sq")):
                t.set(k, precision_field(role, p), rel * row[base] * lognorm(0.3))
            # the measured output error, near the random-error model, and its Fisher projection
            dy = (t.get(k, precision_field("ex", p)) * row["w_sq"] + row["x_sq"] * t.get(k, precision_field("ew", p))) / kk
            t.set(k, precision_field("dy_sq", p), dy * lognorm(0.3))
            t.set(k, precision_field("gdy_sq", p), dy * row["gy_sq"] / (tokens * m) * lognorm(0.5))
    return t


def estimate_and_solve_70b(repeats: int = 3) -> tuple[float, object]:
    from snip_megatron.estimate import EstimateConfig, cost_table
    from snip_megatron.planner.config import PlannerConfig
    from snip_megatron.planner.flops import flop_table
    from snip_megatron.planner.solve import solve_plan
    from snip_megatron.shapes import get_shape

    shape = get_shape("llama_70b")
    stats = synthetic_stats(shape, tokens=shape.seq_length)
    flops = flop_table(shape)
    stages = {k: (k.layer - 1) // (shape.num_layers // 8) for k in flops}
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        costs = cost_table(stats, EstimateConfig())
        result = solve_plan(costs.costs, flops, PlannerConfig(rho=0.75), stages=stages)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure_cost(pairs: int, mbs: int, error_token_stride: int | None = None,
                 grad_error_token_stride: int | None = None, with_eager: bool = False,
                 clock=time.perf_counter) -> dict:
    import dataclasses

    from snip_megatron.formats.cpu_kernel import eager_cpu_path

    from snip_megatron.config import SnipConfig
    from snip_megatron.plan import Plan
    from snip_megatron.stats import measure_step
    from snip_megatron.train.config import TrainConfig
    from snip_megatron.train.loop import Trainer

    tr = Trainer(TrainConfig(model="llama_tiny", steps=4 * pairs + 4, micro_batch_size=mbs,
                             global_batch_size=mbs, eval_interval=None, progress=False))
    snip = SnipConfig()
    config = snip.measure_config()  # the controller's measurement
    if error_token_stride is not None:
        config = dataclasses.replace(config, error_token_stride=error_token_stride)
    if grad_error_token_stride is not None:
        config = dataclasses.replace(config, grad_error_token_stride=grad_error_token_stride)
    n = tr.shape.num_layers
    plans = {"bf16": Plan.uniform(n, "bf16"), "initial": Plan.uniform(n, snip.initial_precision)}
    ratios = {name: [] for name in plans}
    times = {"measure": [], **{name: [] for name in plans}}
    if with_eager:
        ratios["bf16_eager"], times["measure_eager"] = [], []

    def timed_step(plan):
        tr.set_plan(plan)
        start = clock()
        tr.train_step()
        return clock() - start

    timed_step(plans["bf16"])  # warm-up
    for _ in range(pairs):
        step_t = {name: timed_step(plan) for name, plan in plans.items()}
        tr.set_plan(plans["initial"])
        tr.current_batch = tr.reader.take(tr.num_microbatches)
        start = clock()
        measure_step(tr, config)
        m = clock() - start
        if with_eager:  # the same measurement on the eager quantizer path, same batch
            start = clock()
            with eager_cpu_path():
                measure_step(tr, config)
            m_eager = clock() - start
            times["measure_eager"].append(m_eager)
            ratios["bf16_eager"].append(m_eager / step_t["bf16"])
        tr.current_batch = None
        times["measure"].append(m)
        for name in plans:
            times[name].append(step_t[name])
            ratios[name].append(m / step_t[name])
    return {"ratio": {k: statistics.median(v) for k, v in ratios.items()},
            "median_s": {k: statistics.median(v) for k, v in times.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=5, help="interleaved (steps, measurement) rounds")
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--loop-steps", type=int, default=2000, help="steps of each side-by-side loop run")
    ap.add_argument("--no-loop", action="store_true", help="skip the whole-loop overhead runs")
    ap.add_argument("--error-token-stride", type=int, default=None,
                    help="measure the errors on every n-th token chunk (default: the controller's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time steps and measurements in process CPU time (set "
                         "OMP_WAIT_POLICY=passive), less disturbed by other jobs on the machine")
    ap.add_argument("--with-eager", action="store_true",
                    help="also time the measurement on the eager quantizer path, side by side")
    ap.add_argument("--grad-error-token-stride", type=int, default=None,
                    help="the same for the backward-GEMM roles (default: the controller's)")
    args = ap.parse_args(argv)

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cost = measure_cost(args.pairs, args.mbs, args.error_token_stride, args.grad_error_token_stride,
                        args.with_eager, clock)
    print(f"llama_tiny, micro-batch {args.mbs}: median measurement {cost['median_s']['measure']:.3f}s; "
          f"BF16 step {cost['median_s']['bf16']:.3f}s; initial-plan (emulated FP8) step "
          f"{cost['median_s']['initial']:.3f}s")
    print(f"measurement = {cost['ratio']['bf16']:.2f} BF16 steps = {cost['ratio']['initial']:.2f} "
          f"initial-plan steps")
    if args.with_eager:
        print(f"eager quantizer path: median measurement {cost['median_s']['measure_eager']:.3f}s "
              f"= {cost['ratio']['bf16_eager']:.2f} BF16 steps")
    cpu_s, result = estimate_and_solve_70b()
    print(f"70B layout (320 linears, PP=8 per-stage budgets, rho=0.75): estimate + solve "
          f"{cpu_s:.3f}s median of 3; solver {getattr(result, 'solver', '?')}")
    loop = ""
    if not args.no_loop:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from loop_overhead import loop_overhead

        for interval, f in loop_overhead((100, 1000), args.loop_steps).items():
            print(f"interval {interval}: {f['updates']} updates; fixed plan {f['plain_s']:.1f}s, with SNIP "
                  f"{f['snip_s']:.1f}s ({f['overhead_pct']:+.2f}%); inside the controller's hooks "
                  f"{f['hook_s']:.2f}s ({f['hook_pct']:.2f}%)")
            loop += f" loop_overhead_pct_{interval}={f['overhead_pct']:.2f}"
    print(f"RESULT measure_step_equiv={cost['ratio']['bf16']:.2f} cpu_s_70b={cpu_s:.3f}{loop}")


if __name__ == "__main__":
    main()
