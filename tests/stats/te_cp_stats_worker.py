"""The measurement on Megatron's TE layer spec (over the TE test double) at context parallelism CP =
the number of processes: the same weights and micro-batches, each rank its tokens of them by
Megatron's load-balanced split (get_batch_on_this_cp_rank). Used by tests/stats/test_measure_te.py.

    torchrun --nproc_per_node {1,2} tests/stats/te_cp_stats_worker.py --out DIR [--mla]

Needs `tests/te_double` on PYTHONPATH. Global rank 0 writes DIR/cp<N>.npy (the reduced table) and
DIR/cp<N>.json (its keys, and what the core attention of every layer ran: CP size, query and key
tokens). The loss is Megatron-LM's (pretrain_gpt's loss_func: the masked sum and the token count,
which Megatron's schedule divides), whose gradients Megatron's DDP averages over DP x CP; the loss
masks are whole, so the CP ranks' mean losses average to the whole sequence's.
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.stats.measure_worker import MLA  # noqa: E402
from tests.te.te_worker import SHAPE, build_te_gpt, fixed_batches, reinit_by_global_name, require_double  # noqa: E402


def cp_batches(cp_group) -> list:
    """This rank's tokens of the step's two micro-batches (loss masks whole)."""
    from snip_megatron.megatron.batch import on_this_cp_rank

    out = []
    for batch in fixed_batches():
        batch["loss_mask"] = torch.ones_like(batch["loss_mask"])
        out.append(on_this_cp_rank(batch, cp_group))
    return out


def forward_step(data_iterator, model):
    """Megatron-LM's forward step and loss (sum over the rank's tokens, their count, the report)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"].reshape(-1).float()
        loss = (output_tensor.reshape(-1).float() * mask).sum()
        count = mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    return output, loss_func


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mla", action="store_true")
    args = p.parse_args()
    require_double()
    from megatron.core import parallel_state as ps

    from snip_megatron.megatron import runtime
    from snip_megatron.stats.config import MeasureConfig
    from snip_megatron.stats.measure import measure_chunks

    runtime.init_process_group()
    cp = dist.get_world_size()
    runtime.initialize_model_parallel(tp=1, pp=1, cp=cp, seed=1234)
    model = build_te_gpt(context_parallel_size=cp, **(dict(mla=MLA) if args.mla else {}))
    reinit_by_global_name(model)  # the same weights at any CP
    table = measure_chunks([model], forward_step, cp_batches(ps.get_context_parallel_group()),
                           seq_length=SHAPE.seq_length, micro_batch_size=2,
                           config=MeasureConfig(noise_frac=0.05, seed=3, micro_batches=None))
    attention = {name: [m.cp_size, *m.last_tokens] for name, m in model.named_modules()
                 if name.endswith("core_attention")}
    if dist.get_rank() == 0:
        np.save(Path(args.out) / f"cp{cp}.npy", table.to_array())
        (Path(args.out) / f"cp{cp}.json").write_text(json.dumps({"keys": [str(k) for k in table.keys],
                                                                  "attention": attention}))
    dist.barrier()
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
