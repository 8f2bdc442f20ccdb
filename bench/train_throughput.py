"""Training throughput of a tiny model with every planned linear in BF16, FP8 and FP4 (emulated).

    python bench/train_throughput.py                      # llama_tiny on the stdlib corpus, CPU
    python bench/train_throughput.py --rounds 5 --steps-per-round 10
    python bench/train_throughput.py --model llama_1b --num-layers 1 --vocab-size 4096 \
        --seq-length 256 --micro-batch-size 1        # one llama_1b-shaped layer: GEMMs dominate

One Trainer, one model: the precisions take turns in rounds (each round times `steps-per-round`
optimizer steps per precision after a warm-up step), so a busy machine slows all three alike. The
ratios are the emulation slowdown (tokens/s relative to BF16; below 1 is slower). No target yet:
record it. Last line: `RESULT fp8_vs_bf16=<ratio> fp4_vs_bf16=<ratio>`. With --with-eager, FP8 and FP4
also take turns on the eager quantizer path (what runs without the compiled CPU kernel), and the
line adds fp8_eager_vs_bf16 and fp4_eager_vs_bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from snip_megatron.data.prepare import DEFAULT_CACHE_DIR, DataConfig
from snip_megatron.formats.cpu_kernel import eager_cpu_path
from snip_megatron.plan import Plan
from snip_megatron.shapes import get_shape
from snip_megatron.train.config import TrainConfig
from snip_megatron.train.loop import Trainer

PRECISIONS = ("bf16", "fp8", "fp4")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama_tiny")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary")
    p.add_argument("--seq-length", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--data-cache", default=DEFAULT_CACHE_DIR)
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus cap (stdlib sources)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: time steps in process CPU time (set OMP_WAIT_POLICY=passive), a "
                        "figure a machine shared with other jobs disturbs less than wall time")
    p.add_argument("--with-eager", action="store_true",
                   help="also time FP8/FP4 on the eager quantizer path, side by side")
    args = p.parse_args(argv)
    precisions = PRECISIONS + (("fp8_eager", "fp4_eager") if args.with_eager else ())
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    shape = get_shape(args.model)
    overrides = {"num_layers": args.num_layers, "vocab_size": args.vocab_size, "seq_length": args.seq_length}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        shape = shape.with_(**overrides)
    per_precision = args.rounds * (args.steps_per_round + 1)
    config = TrainConfig(model=shape, steps=per_precision * len(precisions),
                         micro_batch_size=args.micro_batch_size, eval_interval=None, progress=False,
                         data=DataConfig(vocab_size=shape.vocab_size, cache_dir=args.data_cache,
                                         max_bytes=args.max_bytes))
    trainer = Trainer(config)
    tokens_per_step = trainer.global_batch_size * config.seq_len
    times = {p: [] for p in precisions}
    for _ in range(args.rounds):
        for precision in precisions:
            eager = precision.endswith("_eager")
            trainer.set_plan(Plan.uniform(shape.num_layers, precision.removesuffix("_eager")))
            with eager_cpu_path() if eager else contextlib.nullcontext():
                trainer.train_step()  # warm-up: first step after a switch builds new quantizer state
                for _ in range(args.steps_per_round):
                    start = clock()
                    trainer.train_step()
                    times[precision].append(clock() - start)
    trainer.close()

    if trainer.is_reporter:
        print(f"{args.model}: {shape.num_layers} layers, hidden {shape.hidden_size}, "
              f"{tokens_per_step} tokens/step, {args.rounds} x {args.steps_per_round} timed steps each")
        tps = {}
        for precision in precisions:
            step = statistics.median(times[precision])
            tps[precision] = tokens_per_step / step
            print(f"  {precision:9s} {tps[precision]:10.0f} tokens/s  {step * 1e3:8.1f} ms/step (median)")
        print("RESULT " + " ".join(f"{p}_vs_bf16={tps[p] / tps['bf16']:.3f}" for p in precisions[1:]))


if __name__ == "__main__":
    main()
