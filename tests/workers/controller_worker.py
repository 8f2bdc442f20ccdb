"""One training run with the SNIP controller, under torchrun or alone; writes what each rank saw.

    python tests/workers/controller_worker.py --out DIR [--tp 2 | --pp 2 | --dp] [--load CKPT] ...

Per rank, DIR/rank<r>.json holds: the plans the controller applied (step, digest), the final
plan digest, the losses per step, and the number of collectives the controller's hooks issued
on each step (counted by wrapping torch.distributed's collectives during hook calls).
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from snip_megatron.config import SnipConfig  # noqa: E402
from snip_megatron.controller import SnipController  # noqa: E402
from snip_megatron.data.prepare import DataConfig  # noqa: E402
from snip_megatron.formats.precision import Formats  # noqa: E402
from snip_megatron.shapes import ModelShape  # noqa: E402
from snip_megatron.train.config import TrainConfig  # noqa: E402
from snip_megatron.train.loop import Trainer  # noqa: E402

SHAPE = ModelShape(name="ctrl_test", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                   num_attention_heads=4, num_query_groups=2, vocab_size=512, seq_length=64)
COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "barrier",
               "broadcast_object_list")
# Point-to-point ops are left alone: P2POp checks their identity, and the controller uses none.


class CountingController(SnipController):
    """Counts torch.distributed calls made while the controller's step hooks run."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls_per_step: dict[int, int] = {}
        self._counting = False
        self._originals = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        for name, fn in self._originals.items():
            setattr(dist, name, self._wrap(fn))

    def _wrap(self, fn):
        def counted(*a, **k):
            if self._counting:
                self.calls_per_step[self._step] = self.calls_per_step.get(self._step, 0) + 1
            return fn(*a, **k)
        return counted

    def on_step_start(self, trainer, step):
        self._step, self._counting = step, True
        self.calls_per_step.setdefault(step, 0)
        try:
            super().on_step_start(trainer, step)
        finally:
            self._counting = False

    def on_step_end(self, trainer, step, metrics=None):
        self._step, self._counting = step, True
        try:
            super().on_step_end(trainer, step, metrics)
        finally:
            self._counting = False


def inject_failures(ctrl, measure_rank, apply_rank, measure_times=1):
    """Make one rank's first `measure_times` measurements (a statistics hook of each) or its first
    plan change raise."""
    from snip_megatron.stats import tokens

    apply = ctrl._apply
    state = {"failed_steps": set(), "applied": 0}
    sum_sq = tokens.sum_sq

    def failing_sum_sq(t):  # once per measurement, in the first `measure_times` of them
        failed = state["failed_steps"]
        if dist.get_rank() == measure_rank and ctrl._step not in failed and len(failed) < measure_times:
            failed.add(ctrl._step)
            raise RuntimeError("injected statistics failure")
        return sum_sq(t)

    if measure_rank is not None:
        tokens.sum_sq = failing_sum_sq

    def failing_apply(ctx, plan):
        state["applied"] += 1
        if dist.get_rank() == apply_rank and state["applied"] == 2:  # 1 is the initial plan
            raise RuntimeError("injected apply failure")
        return apply(ctx, plan)

    ctrl._apply = failing_apply


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--data-cache", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--load", default=None)
    p.add_argument("--load-step", type=int, default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--save-interval", type=int, default=None)
    p.add_argument("--no-snip", action="store_true")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--interval", type=int, default=100)
    p.add_argument("--lag", type=int, default=1)
    p.add_argument("--initial", default="fp8", help="precision before the first plan")
    p.add_argument("--fp8-recipe", default="blockwise", help="SnipConfig.fp8_recipe")
    p.add_argument("--fail-measure-rank", type=int, default=None,
                   help="this rank's first measurement raises (a failure injected for the test)")
    p.add_argument("--fail-measure-times", type=int, default=1,
                   help="how many of that rank's measurements raise, from its first")
    p.add_argument("--fail-apply-rank", type=int, default=None,
                   help="this rank's first plan change after the initial plan raises")
    args = p.parse_args()

    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    dp = world // (args.tp * args.pp)
    train = TrainConfig(model=SHAPE, steps=args.steps, micro_batch_size=4 // dp, global_batch_size=4,
                        lr=3e-3, warmup_steps=1, eval_interval=None, progress=False, precision=args.initial,
                        tp=args.tp, pp=args.pp, seed=7, save_dir=args.save, save_interval=args.save_interval,
                        load_dir=args.load, load_step=args.load_step,
                        data=DataConfig(corpus="stdlib", vocab_size=SHAPE.vocab_size, max_bytes=400_000,
                                        cache_dir=args.data_cache),
                        formats=Formats(fp8_recipe=args.fp8_recipe))
    hooks = []
    if not args.no_snip:
        snip = SnipConfig(enabled=True, fp4_budget=0.5, warmup=args.warmup, interval=args.interval,
                          lag=args.lag, solver_time_limit_s=60, initial_precision=args.initial,
                          fp8_recipe=args.fp8_recipe)
        ctrl = CountingController(snip, SHAPE, total_steps=args.steps, log=print,
                                  tokens_per_step=train.seq_len * 4)
        inject_failures(ctrl, args.fail_measure_rank, args.fail_apply_rank, args.fail_measure_times)
        hooks.append(ctrl)
    trainer = Trainer(train, hooks=hooks)
    history = trainer.fit()
    out = {"rank": dist.get_rank(), "losses": {m["step"]: m["loss"] for m in history if "loss" in m}}
    if not args.no_snip:
        out.update(applied=[(h["step"], h["plan"]) for h in ctrl.history],
                   final=ctrl.plan.digest(), next_measure=ctrl.next_measure,
                   calls=ctrl.calls_per_step)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    trainer.close()


if __name__ == "__main__":
    main()
