"""Under torchrun (2 processes, EP=2 over two data-parallel replicas): three training steps of the
MoE model with a measurement before step 2 and without; each rank writes whether its parameters and
buffers came out bit-identical. Used by tests/stats/test_measure_moe_parallel.py.

    torchrun --nproc_per_node 2 tests/stats/moe_untouched_worker.py --out DIR
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def train(measured: bool) -> dict:
    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer
    from tests.stats.measure_worker import MOE, build, cpu_current_device

    chunks = build(reinit="global", ep=2, **MOE)
    ddp, opt = wrap_ddp_and_optimizer(chunks, chunks[0].config, lr=1e-2, clip_grad=1.0, distributed_optimizer=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    with cpu_current_device():  # the dispatcher's gather allocates in the backward, outside the CPU shim
        _steps(ddp, opt, measured, rank, world)
    state = {n: t.detach().clone() for n, t in [*chunks[0].named_parameters(), *chunks[0].named_buffers()]}
    runtime.destroy()
    return state


def _steps(ddp, opt, measured, rank, world):
    from snip_megatron.megatron.batch import make_forward_step
    from snip_megatron.stats.measure import measure_chunks
    from tests.stats.measure_worker import SHAPE, batches
    from tests.stats.test_untouched import _train_step

    for step in range(3):
        mbs = batches(seed=step + 1)[rank::world] * 2  # this replica's share, two micro-batches
        if measured and step == 1:
            measure_chunks(ddp, make_forward_step(), batches(seed=99)[rank::world] * 2,
                           seq_length=SHAPE.seq_length, micro_batch_size=2, optimizer=opt)
        _train_step(ddp, opt, mbs)


def main():
    from snip_megatron.megatron import runtime

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runtime.init_process_group()
    with_measure, without = train(True), train(False)
    differ = [n for n in with_measure if not torch.equal(with_measure[n], without[n])]
    with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump({"names": sorted(with_measure), "differ": differ}, f)
    dist.barrier()
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
