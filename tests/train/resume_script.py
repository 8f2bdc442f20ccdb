"""Run under torchrun by test_resume_distributed.py. For each layout (TP=2; DP=2 with the
distributed optimizer): train 4 steps saving at step 3, then resume a fresh Trainer from step 3 and
run step 4 again. The reporting rank writes the losses as JSON."""

import argparse
import json
import sys
from pathlib import Path

LAYOUTS = {"tp2": dict(tp=2), "dp2-distopt": dict(tp=1, distributed_optimizer=True)}


def main() -> None:
    # Imports live here: Megatron's checkpoint writer starts a 'spawn' manager process, which
    # re-imports this module; a bare module keeps that cheap (and a main guard is required).
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import TINY

    from snip_megatron.data.prepare import DataConfig
    from snip_megatron.megatron import runtime
    from snip_megatron.train.config import TrainConfig
    from snip_megatron.train.loop import Trainer

    p = argparse.ArgumentParser()
    p.add_argument("--layouts", default="tp2,dp2-distopt")
    p.add_argument("--data-cache", required=True)
    p.add_argument("--work", required=True)
    args = p.parse_args()

    data = DataConfig(corpus="stdlib", vocab_size=TINY.vocab_size, max_bytes=1_000_000,
                      cache_dir=args.data_cache)
    results = {}
    for name in args.layouts.split(","):
        ckpt = str(Path(args.work) / name)
        common = dict(model=TINY, data=data, steps=4, micro_batch_size=4, global_batch_size=8, lr=3e-3,
                      warmup_steps=1, precision="fp8", eval_interval=None, progress=False,
                      **LAYOUTS[name])
        full = Trainer(TrainConfig(save_dir=ckpt, save_interval=3, **common))
        full_losses = [m["loss"] for m in full.fit()]
        full.close()
        resumed = Trainer(TrainConfig(load_dir=ckpt, load_step=3, **common))
        resumed_losses = [m["loss"] for m in resumed.fit()]
        results[name] = {"full": full_losses, "resumed": resumed_losses, "tp": resumed.config.tp,
                         "dp": resumed.dp_size}
        reporter = resumed.is_reporter
        resumed.close()
    if reporter:
        (Path(args.work) / "result.json").write_text(json.dumps(results))
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
