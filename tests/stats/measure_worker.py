"""Run one measurement on a tiny Llama-like model under torchrun (or one process) and save the
reduced table (global rank 0) as .npy. Used by tests/stats/test_measure_parallel.py.

    torchrun --nproc_per_node 2 tests/stats/measure_worker.py --layouts tp2,pp2,dp2 --out DIR
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist

from snip_megatron.megatron import runtime
from snip_megatron.shapes import ModelShape

SHAPE = ModelShape(name="stats_tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                   num_attention_heads=4, num_query_groups=2, vocab_size=256, seq_length=32)


def batches(num=2, mbs=2, seed=7):
    from snip_megatron.megatron.batch import random_batch

    g = torch.Generator().manual_seed(seed)  # the same data on every rank and replica
    return [random_batch(mbs, SHAPE.seq_length, SHAPE.vocab_size, g) for _ in range(num)]


def build(tp=1, pp=1, seed=1234, reinit=True):
    from snip_megatron.megatron.model import build_model_chunks

    runtime.initialize_model_parallel(tp=tp, pp=pp, seed=seed)
    runtime.seed_all(seed)
    chunks = build_model_chunks(SHAPE, backend="local")
    if tp == 1 and reinit:
        # Pipeline stages initialise their layers from different RNG states: give every matrix
        # weights that depend only on its global name, as a single process would have.
        for chunk in chunks:
            named = [(n, p) for n, p in chunk.named_parameters() if "layers" not in n]
            for layer in chunk.decoder.layers:
                named += [(f"{layer.layer_number}.{n}", p) for n, p in layer.named_parameters()]
            for name, p in named:
                if p.dim() == 2:
                    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + p.numel())
                    with torch.no_grad():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return chunks


LAYOUTS = {  # name -> (tp, pp, keep Megatron's own init)
    "single": (1, 1, False), "single_megatron": (1, 1, True),
    "tp2": (2, 1, True), "pp2": (1, 2, False), "dp2": (1, 1, False), "single4": (1, 1, False),
}
DP2_STEP = 4
"""Micro-batches in the dp2 step: each DP rank measures its share, as Megatron's sampler deals
them (rank r: micro-batches r, r + 2, ...); single4 measures the whole step in one process."""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="single", help=f"comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--out", required=True, help="folder for <layout>.npy")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runtime.init_process_group()
    for name in args.layouts.split(","):
        table = measure_layout(name)
        if dist.get_rank() == 0:
            np.save(f"{args.out}/{name}.npy", table.to_array())
    dist.barrier()
    runtime.destroy(process_group=True)


def measure_layout(name: str):
    """Build the model of layout `name`, measure one step, tear the parallel state down."""
    from snip_megatron.megatron.batch import make_forward_step
    from snip_megatron.stats.config import MeasureConfig
    from snip_megatron.stats.measure import measure_chunks
    from snip_megatron.stats.quant_error import blockwise_error_fn

    # "<layout>_lone": a step of one micro-batch of 4, whose noise pass runs its two halves
    base, lone = (name[:-5], True) if name.endswith("_lone") else (name, False)
    tp, pp, megatron_init = LAYOUTS[base]
    chunks = build(tp, pp, reinit=not megatron_init)
    data, mbs = (batches(num=1, mbs=4), 4) if lone else (batches(), 2)
    if base in ("dp2", "single4"):
        data = batches(num=DP2_STEP)
        if base == "dp2":
            data = data[dist.get_rank()::dist.get_world_size()]
    try:
        return measure_chunks(chunks, make_forward_step(), data, seq_length=SHAPE.seq_length,
                       micro_batch_size=mbs, config=MeasureConfig(noise_frac=0.05),
                       error_fn=blockwise_error_fn())
    finally:
        runtime.destroy()


if __name__ == "__main__":
    main()
