"""Run one measurement on a tiny Llama-like model under torchrun (or one process) and save the
reduced table (global rank 0) as .npy. Used by tests/stats/test_measure_parallel.py.

    torchrun --nproc_per_node 2 tests/stats/measure_worker.py --layouts tp2,pp2,dp2 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import torch
import torch.distributed as dist

from snip_megatron.megatron import runtime
from snip_megatron.models.gpt import MLADims
from snip_megatron.shapes import ModelShape

SHAPE = ModelShape(name="stats_tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                   num_attention_heads=4, num_query_groups=2, vocab_size=256, seq_length=32)


def batches(num=2, mbs=2, seed=7):
    from snip_megatron.megatron.batch import random_batch

    g = torch.Generator().manual_seed(seed)  # the same data on every rank and replica
    return [random_batch(mbs, SHAPE.seq_length, SHAPE.vocab_size, g) for _ in range(num)]


FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
LAYOUTS = {  # name -> (tp, pp, keep Megatron's own init, TransformerConfig overrides, micro-batches measured)
    "single": (1, 1, False, {}, None), "single_megatron": (1, 1, True, {}, None),
    "tp2": (2, 1, True, {}, None), "pp2": (1, 2, False, {}, None), "dp2": (1, 1, False, {}, None),
    # the layouts of a 70B run: activation recompute, sequence parallelism, and both
    "full_recompute": (1, 1, False, FULL_RECOMPUTE, None),
    "selective_attn": (1, 1, False, dict(recompute_granularity="selective", recompute_modules=["core_attn"]), None),
    "selective_mlp": (1, 1, False, dict(recompute_granularity="selective", recompute_modules=["mlp"]), None),
    "tp2_sp": (2, 1, True, dict(sequence_parallel=True), None),
    "tp2_sp_full": (2, 1, True, dict(sequence_parallel=True, **FULL_RECOMPUTE), None),
    "pp2_full": (1, 2, False, FULL_RECOMPUTE, None),
    # micro-batch sampling: one of two micro-batches in one process, one per replica of two
    "dp2_k2": (1, 1, False, {}, 2),
    # a step of DP2_STEP micro-batches: dp2 and dp2_k2 deal it across two replicas, single4 measures
    # it whole in one process, pair the two micro-batches dp2_k2 samples (its replicas' second ones)
    "single4": (1, 1, False, {}, None), "pair": (1, 1, False, {}, None),
}
# multi-latent attention (down-projections duplicated over TP, as in Megatron's TE spec), with
# q_lora_rank (mla_*) and without (mlaq_*); every width a multiple of the error function's 16-element
# blocks. Megatron's MLA needs sequence parallelism at TP > 1 (megatron/mla.py says why).
MLA = MLADims(q_lora_rank=32, kv_lora_rank=48, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16)
MLA_NO_Q_LORA = MLADims(q_lora_rank=None, kv_lora_rank=48, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16)
for _prefix, _dims in (("mla", MLA), ("mlaq", MLA_NO_Q_LORA)):
    LAYOUTS.update({f"{_prefix}_single": (1, 1, True, dict(mla=_dims), None),
                    f"{_prefix}_tp2_sp": (2, 1, True, dict(mla=_dims, sequence_parallel=True), None)})
# MLA at PP=2 and its reference: every matrix re-drawn from its global name (stages draw from
# different RNG states)
LAYOUTS.update({"mla_name": (1, 1, False, dict(mla=MLA), None), "mla_pp2": (1, 2, False, dict(mla=MLA), None)})
# multi-token prediction: one MTP layer (Megatron builds it on the last pipeline stage) after an MLA
# decoder at TP=2 with SP (mtpmla_*), after a dense one at PP=2 (mtp_*)
MTP = dict(mtp_num_layers=1)
LAYOUTS.update({"mtpmla_single": (1, 1, True, dict(mla=MLA, **MTP), None),
                "mtpmla_tp2_sp": (2, 1, True, dict(mla=MLA, sequence_parallel=True, **MTP), None),
                "mtp_single": (1, 1, False, MTP, None), "mtp_pp2": (1, 2, False, MTP, None)})
DP2_STEP = 4
"""Micro-batches in the dp2 step, dealt as Megatron's sampler deals them (replica r: the step's
micro-batches r, r + 2, ...)."""


@contextlib.contextmanager
def sp_tolerant_norms():
    """Test double for Transformer Engine's norms: Megatron's torch norm refuses sequence
    parallelism (its weight gradient would need the all-reduce TE's norms get); a measurement
    freezes the parameters and a norm is per token, so torch's RMSNorm stands in."""
    from megatron.core.transformer import torch_norm

    saved = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **_):
        return torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)

    torch_norm.WrappedTorchNorm.__new__ = new
    try:
        yield
    finally:
        torch_norm.WrappedTorchNorm.__new__ = saved


@contextlib.contextmanager
def cpu_current_device():
    """Sequence parallelism's reduce-scatter allocates with device=torch.cuda.current_device() in
    the backward, where the CPU shim's TorchFunctionMode (which maps the shim's 0 to the CPU) is
    not active: report the CPU device itself while an SP layout runs."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def build(tp=1, pp=1, seed=1234, reinit=True, **overrides):
    from snip_megatron.megatron.model import build_model_chunks

    runtime.initialize_model_parallel(tp=tp, pp=pp, seed=seed)
    runtime.seed_all(seed)
    with sp_tolerant_norms() if overrides.get("sequence_parallel") else contextlib.nullcontext():
        chunks = build_model_chunks(SHAPE, backend="local", **overrides)
    if tp == 1 and reinit:
        # Pipeline stages initialise their layers from different RNG states: give every matrix
        # weights that depend only on its global name, as a single process would have (an MTP
        # layer's name is the same on the last stage as in one process).
        for chunk in chunks:
            named = [(n, p) for n, p in chunk.named_parameters() if not n.startswith("decoder.layers")]
            for layer in chunk.decoder.layers:
                named += [(f"{layer.layer_number}.{n}", p) for n, p in layer.named_parameters()]
            for name, p in named:
                if p.dim() == 2:
                    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + p.numel())
                    with torch.no_grad():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return chunks


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
    tp, pp, megatron_init, overrides, k = LAYOUTS[base]
    chunks = build(tp, pp, reinit=not megatron_init, **overrides)
    data, mbs = (batches(num=1, mbs=4), 4) if lone else (batches(), 2)
    if base in ("dp2", "dp2_k2", "single4", "pair"):
        data = batches(num=DP2_STEP)
        if base.startswith("dp2"):
            data = data[dist.get_rank()::dist.get_world_size()]
        elif base == "pair":
            data = data[2:]
    try:
        with cpu_current_device() if overrides.get("sequence_parallel") else contextlib.nullcontext():
            return measure_chunks(chunks, make_forward_step(), data, seq_length=SHAPE.seq_length,
                                  micro_batch_size=mbs, config=MeasureConfig(noise_frac=0.05, micro_batches=k),
                                  error_fn=blockwise_error_fn())
    finally:
        runtime.destroy()


if __name__ == "__main__":
    main()
