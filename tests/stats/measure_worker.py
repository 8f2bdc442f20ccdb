"""Run one measurement on a tiny Llama-like model under torchrun (or one process) and save the
reduced table (global rank 0) as .npy. Used by tests/stats/test_measure_parallel.py.

    torchrun --nproc_per_node 2 tests/stats/measure_worker.py --tp 2 --out /path/t.npy
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


def build(tp=1, pp=1, seed=1234):
    from snip_megatron.megatron.model import build_model_chunks

    runtime.initialize_model_parallel(tp=tp, pp=pp, seed=seed)
    runtime.seed_all(seed)
    return build_model_chunks(SHAPE, backend="local")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from snip_megatron.megatron.batch import make_forward_step
    from snip_megatron.stats.config import MeasureConfig
    from snip_megatron.stats.measure import measure
    from snip_megatron.stats.quant_error import blockwise_error_fn

    chunks = build(args.tp, args.pp)
    table = measure(chunks, make_forward_step(), batches(), seq_length=SHAPE.seq_length,
                    micro_batch_size=2, config=MeasureConfig(noise_frac=0.05),
                    error_fn=blockwise_error_fn())
    if dist.get_rank() == 0:
        np.save(args.out, table.to_array())
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
