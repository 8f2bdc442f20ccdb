"""Run under torchrun by test_resume_distributed.py: train 4 steps saving at step 3, then resume a
fresh Trainer from step 3 and run step 4 again; the reporting rank writes both losses as JSON."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TINY  # noqa: E402

from snip_megatron.data.prepare import DataConfig  # noqa: E402
from snip_megatron.megatron import runtime  # noqa: E402
from snip_megatron.train.config import TrainConfig  # noqa: E402
from snip_megatron.train.loop import Trainer  # noqa: E402


def main() -> None:
    # A main guard is required: Megatron's checkpoint writer starts a 'spawn' manager process,
    # which re-imports the __main__ module.
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--data-cache", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    data = DataConfig(corpus="stdlib", vocab_size=TINY.vocab_size, max_bytes=1_000_000, cache_dir=args.data_cache)
    common = dict(model=TINY, data=data, steps=4, micro_batch_size=4, lr=3e-3, warmup_steps=1, tp=args.tp,
                  distributed_optimizer=args.distributed_optimizer, precision="fp8", eval_interval=None,
                  progress=False)
    full = Trainer(TrainConfig(save_dir=args.ckpt, save_interval=3, **common))
    full_losses = [m["loss"] for m in full.fit()]
    full.close()
    resumed = Trainer(TrainConfig(load_dir=args.ckpt, load_step=3, **common))
    resumed_losses = [m["loss"] for m in resumed.fit()]
    if resumed.is_reporter:
        Path(args.out).write_text(json.dumps({"full": full_losses, "resumed": resumed_losses,
                                              "world": resumed.world_size, "dp": resumed.dp_size}))
    resumed.close()
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
