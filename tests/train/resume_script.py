"""Run under torchrun by test_resume_distributed.py. For each layout (TP=2; DP=2 with the
distributed optimizer; with SNIP: DP=2 with the distributed optimizer, and MLA at PP=2 and at DP=2
with the distributed optimizer): train 4 steps saving at step 3, then resume a fresh Trainer from
step 3 and run step 4 again. With SNIP the controller measures at step 2 and applies its plan at
step 3, and the resumed run takes the checkpoint's plan. The reporting rank writes the losses (and
SNIP's plans) as JSON."""

import argparse
import json
import sys
from pathlib import Path

LAYOUTS = {"tp2": dict(tp=2), "dp2-distopt": dict(tp=1, distributed_optimizer=True),
           "snip-dp2-distopt": dict(tp=1, distributed_optimizer=True),
           "snip-mla-pp2": dict(pp=2, mla=True), "snip-mla-dp2-distopt": dict(distributed_optimizer=True, mla=True)}
MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16)


def main() -> None:
    # Imports live here: Megatron's checkpoint writer starts a 'spawn' manager process, which
    # re-imports this module; a bare module keeps that cheap (and a main guard is required).
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import TINY

    from snip_megatron.config import SnipConfig
    from snip_megatron.controller import SnipController
    from snip_megatron.data.prepare import DataConfig
    from snip_megatron.megatron import runtime
    from snip_megatron.models.gpt import MLADims
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
        layout = dict(LAYOUTS[name])
        mla = MLADims(**MLA) if layout.pop("mla", False) else None
        model = TINY.with_(num_query_groups=TINY.num_attention_heads) if mla else TINY  # MLA: no GQA
        common = dict(model=model, mla=mla, data=data, steps=4, micro_batch_size=4, global_batch_size=8, lr=3e-3,
                      warmup_steps=1, precision="fp8", eval_interval=None, progress=False, **layout)

        def hooks():  # SNIP measures at step 2 and plans at step 3
            if not name.startswith("snip-"):
                return []
            snip = SnipConfig(enabled=True, fp4_budget=0.5, warmup=2, interval=10, lag=1).resolved("emulated")
            return [SnipController(snip, model, total_steps=4, log=print, tokens_per_step=model.seq_length * 8,
                                   inventory=TrainConfig(**common).inventory)]

        full = Trainer(TrainConfig(save_dir=ckpt, save_interval=3, **common), hooks=hooks())
        full_losses = [m["loss"] for m in full.fit()]
        plans = [str(h.plan.counts()) for h in full.hooks]
        full.close()
        resumed = Trainer(TrainConfig(load_dir=ckpt, load_step=3, **common), hooks=hooks())
        resumed_losses = [m["loss"] for m in resumed.fit()]
        results[name] = {"full": full_losses, "resumed": resumed_losses, "tp": resumed.config.tp,
                         "pp": resumed.config.pp, "dp": resumed.dp_size, "plans": plans,
                         "resumed_plans": [str(h.plan.counts()) for h in resumed.hooks]}
        reporter = resumed.is_reporter
        resumed.close()
    if reporter:
        (Path(args.work) / "result.json").write_text(json.dumps(results))
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
