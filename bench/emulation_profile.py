"""Where an emulated training step's time goes: quantization, stochastic-rounding noise, GEMMs, the rest.

    python bench/emulation_profile.py                       # llama_tiny, BF16 / FP8 / FP4 plans
    python bench/emulation_profile.py --model llama_1b --num-layers 1 --vocab-size 4096 \
        --seq-length 256 --micro-batch-size 1

The emulated linears' parts are timed with clocks around their calls (wall, or with --clock cpu
this process's CPU time; CPU runs them synchronously): `quantize` (each cast, by role), `noise`
(seeding the stochastic-rounding noise; the kernel draws the bits inside `quantize`), `gemm` (the
three GEMMs, FP32 for quantized operands); `rest` is the step minus those (attention, norms, the
optimizer, BF16 ops). For one cast of each role the number of eager ops it dispatches is counted
with torch's profiler, and its time is set against a copy of the same tensor. The precisions take
turns in rounds, as in bench/train_throughput.py. Last line:

    RESULT fp8_vs_bf16=<r> fp4_vs_bf16=<r> quantize_share_fp4=<s> ops_per_cast_fp4=<n> us_per_op_fp4=<t>

(throughput ratios; the share of the FP4 step spent in quantization; the mean ops per FP4 cast and
the wall time per op they imply.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from snip_megatron.data.prepare import DEFAULT_CACHE_DIR, DataConfig
from snip_megatron.formats import FormatSpec, Role, Rounding, quantize_for_role
from snip_megatron.formats.sr_noise import CounterNoise
from snip_megatron.plan import Plan
from snip_megatron.shapes import get_shape
from snip_megatron.train.config import TrainConfig
from snip_megatron.train.loop import Trainer

PRECISIONS = ("bf16", "fp8", "fp4")


class PartTimer:
    """Wall time of the emulated linear's parts, accumulated while `active`."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)
        self.active = False

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += self.clock() - start
                self.calls[part] += 1
        return timed

    @contextmanager
    def measuring(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False


@contextmanager
def instrumented(timer: PartTimer):
    """The emulated linear's quantize, noise and GEMM functions wrapped by `timer`, restored after."""
    # the module (the package exports a function under the same name)
    linear = sys.modules["snip_megatron.emulation.quantized_linear"]
    parts = {"quantize_for_role": "quantize", "_shard_noise": "noise", "_gemm": "gemm"}
    originals = {name: getattr(linear, name) for name in parts}
    for name, part in parts.items():
        setattr(linear, name, timer.wrap(part, originals[name]))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(linear, name, fn)


def cast_ops(spec: FormatSpec, shape: tuple[int, int], repeats: int = 20) -> list[tuple[str, int, float, float]]:
    """(role, eager ops, microseconds per cast, microseconds per copy) for each quantized role of
    `spec` on a [rows, cols] BF16 operand."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(shape).bfloat16()
    noise = CounterNoise(1)  # as the emulated linear's: drawn by the kernel
    rows = []
    for role in Role:
        cast = spec.cast(role)
        if cast is None:
            continue
        kw = {"noise": noise} if cast.rounding is Rounding.STOCHASTIC else {}
        run = lambda: quantize_for_role(x, spec, role, out_dtype=torch.float32, **kw)  # noqa: E731
        run()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
        rows.append((role.value, ops, _median_us(run, repeats), _median_us(lambda: x.float().clone(), repeats)))
    return rows


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama_tiny")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps-per-round", type=int, default=4)
    p.add_argument("--data-cache", default=DEFAULT_CACHE_DIR)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this process's CPU time (steadier on a machine other jobs load)")
    args = p.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    shape = get_shape(args.model)
    overrides = {"num_layers": args.num_layers, "vocab_size": args.vocab_size, "seq_length": args.seq_length}
    shape = shape.with_(**{k: v for k, v in overrides.items() if v is not None})
    config = TrainConfig(model=shape, steps=args.rounds * (args.steps_per_round + 1) * len(PRECISIONS),
                         micro_batch_size=args.micro_batch_size, eval_interval=None, progress=False,
                         data=DataConfig(vocab_size=shape.vocab_size, cache_dir=args.data_cache,
                                         max_bytes=args.max_bytes))
    trainer = Trainer(config)
    timer = PartTimer(clock)
    steps = {p: [] for p in PRECISIONS}
    parts = {p: defaultdict(float) for p in PRECISIONS}
    calls = {p: defaultdict(int) for p in PRECISIONS}
    with instrumented(timer):
        for _ in range(args.rounds):
            for precision in PRECISIONS:
                trainer.set_plan(Plan.uniform(shape.num_layers, precision))
                trainer.train_step()  # warm-up after a switch
                for _ in range(args.steps_per_round):
                    timer.seconds.clear()
                    timer.calls.clear()
                    start = clock()
                    with timer.measuring():
                        trainer.train_step()
                    steps[precision].append(clock() - start)
                    for part, s in timer.seconds.items():
                        parts[precision][part] += s
                        calls[precision][part] += timer.calls[part]
    trainer.close()
    if not trainer.is_reporter:
        return

    tokens = trainer.global_batch_size * config.seq_len
    n = args.rounds * args.steps_per_round
    print(f"{args.model}: {shape.num_layers} layers, hidden {shape.hidden_size}, {tokens} tokens/step, "
          f"{n} timed steps per precision, {torch.get_num_threads()} threads, {args.clock} clock")
    print(f"{'plan':5s} {'ms/step':>8s} {'vs bf16':>8s} {'quantize':>9s} {'noise':>7s} {'gemm':>7s} {'rest':>7s}"
          f"   (ms per step; quantize calls per step)")
    step_ms = {p: statistics.median(steps[p]) * 1e3 for p in PRECISIONS}
    for precision in PRECISIONS:
        mean = {k: v / n * 1e3 for k, v in parts[precision].items()}
        rest = statistics.mean(steps[precision]) * 1e3 - sum(mean.values())
        print(f"{precision:5s} {step_ms[precision]:8.1f} {step_ms['bf16'] / step_ms[precision]:8.3f} "
              f"{mean.get('quantize', 0):9.1f} {mean.get('noise', 0):7.1f} {mean.get('gemm', 0):7.1f} {rest:7.1f}"
              f"   ({calls[precision].get('quantize', 0) // n} casts)")

    operand = (args.micro_batch_size * shape.seq_length, shape.hidden_size)
    summary = {}
    for precision, kw in (("fp8", {}), ("fp4", {})):
        rows = cast_ops(FormatSpec.for_precision(precision, **kw), operand)
        print(f"{precision} casts of a [{operand[0]}, {operand[1]}] BF16 operand: role, eager ops, us per cast, "
              f"us per FP32 copy")
        for role, ops, us, copy_us in rows:
            print(f"  {role:18s} {ops:4d} {us:9.1f} {copy_us:9.1f}")
        summary[precision] = (statistics.mean(r[1] for r in rows), statistics.mean(r[2] for r in rows))
    fp4_mean = {k: v / n for k, v in parts["fp4"].items()}
    share = fp4_mean.get("quantize", 0) / statistics.mean(steps["fp4"])
    ops, us = summary["fp4"]
    print(f"RESULT fp8_vs_bf16={step_ms['bf16'] / step_ms['fp8']:.3f} fp4_vs_bf16={step_ms['bf16'] / step_ms['fp4']:.3f} "
          f"quantize_share_fp4={share:.3f} ops_per_cast_fp4={ops:.0f} us_per_op_fp4={us / ops:.1f}")


if __name__ == "__main__":
    main()
