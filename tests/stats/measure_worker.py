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
# mixture of experts (layer 1: 4 experts top-2 and a gated shared expert, layer 2 dense; expert bias,
# aux and z losses on): every matrix drawn from its global name ("global"), so each layout of TP,
# ETP (expert TP), EP and PP holds the single process's model. With TP > 1 Megatron's MoE layer
# needs sequence parallelism; its tokens then reach the experts in the single process's order.
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[1, 0],
           moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
           moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=32,
           moe_shared_expert_gate=True)
SP = dict(sequence_parallel=True)
LAYOUTS.update({"moe_single": (1, 1, "global", MOE, None), "moe_pp2": (1, 2, "global", MOE, None),
                "moe_tp2_sp_ep2": (2, 1, "global", dict(MOE, ep=2, etp=1, **SP), None),
                # EP=2 over two data-parallel replicas (TP=1): each expert sees both replicas' tokens
                "moe_ep2": (1, 1, "global", dict(MOE, ep=2), None), "moe_single4": (1, 1, "global", MOE, None),
                "moe_tp2_sp_etp2": (2, 1, "global", dict(MOE, **SP), None),
                # activation recompute of the MoE layer: every layer, or Megatron's selective "moe"
                "moe_full_recompute": (1, 1, "global", dict(MOE, **FULL_RECOMPUTE), None),
                "moe_selective_moe": (1, 1, "global", dict(MOE, recompute_granularity="selective",
                                                           recompute_modules=["moe"]), None),
                # 4 processes: TP=2 with SP over two data-parallel replicas, experts on ETP=2 x EP=2
                "moe_tp2_sp_etp2_ep2": (2, 1, "global", dict(MOE, ep=2, etp=2, **SP), None)})
# MoE with multi-token prediction (DeepSeek-V3's layout): layer 2 and the MTP layer MoE (Megatron
# builds the MTP layer from the last decoder layer's spec), at EP=2 with TP=2 and SP, and at PP=2
# with the MTP layer on the last stage
MOE_MTP = dict(MOE, moe_layer_freq=[0, 1], **MTP)
LAYOUTS.update({"moemtp_single": (1, 1, "global", MOE_MTP, None), "moemtp_pp2": (1, 2, "global", MOE_MTP, None),
                "moemtp_tp2_sp_ep2": (2, 1, "global", dict(MOE_MTP, ep=2, etp=1, **SP), None)})
# a DeepSeek-style model (MLA + MoE + MTP; layers 2-4 and the MTP layer MoE) at PP=2 x VPP=2 (four
# chunks of one layer, the MTP layer on the last stage) and at TP=2 + SP x EP=2
DEEPSEEK = dict(MOE, moe_layer_freq=[0, 1, 1, 1], mla=MLA, layers=4, **MTP)
LAYOUTS.update({"ds_single": (1, 1, "global", DEEPSEEK, None),
                "ds_pp2_vpp2": (1, 2, "global", dict(DEEPSEEK, vpp=2), None),
                "ds_tp2_sp_ep2": (2, 1, "global", dict(DEEPSEEK, ep=2, etp=1, **SP), None)})
# Megatron's all-to-all token dispatcher, and expert TP at TP=1 (the experts' ETP group spans
# data-parallel replicas): ETP=2 on two processes, ETP=2 x EP=2 on four. There each expert gets
# four replicas' rows in one forward, more than the quantization errors' row sample leaves whole
# (MeasureConfig.error_token_stride): they are measured on every row ("error_stride": 1), as one
# process measures its fewer rows per forward.
A2A, EVERY_ROW = dict(moe_token_dispatcher_type="alltoall"), dict(error_stride=1)
LAYOUTS.update({"moe_ep2_a2a": (1, 1, "global", dict(MOE, ep=2, **A2A), None),
                "moe_etp2": (1, 1, "global", dict(MOE, etp=2), None),
                "moe_etp2_ep2": (1, 1, "global", dict(MOE, ep=2, etp=2, **EVERY_ROW), None),
                "moe_etp2_ep2_a2a": (1, 1, "global", dict(MOE, ep=2, etp=2, **A2A, **EVERY_ROW), None)})
# layouts on Megatron's TE spec with grouped experts (TEGroupedMLP over the TE double: run with
# tests/te_double on PYTHONPATH), on four processes: EP=2 x EDP=2 with either dispatcher, ETP=2 x
# EP=2 at TP=1, and at TP=2 with sequence parallelism
LAYOUTS.update({f"te{name}": (*LAYOUTS[name][:3], dict(LAYOUTS[name][3], te=True), None)
                for name in ("moe_ep2", "moe_ep2_a2a", "moe_etp2_ep2", "moe_tp2_sp_etp2_ep2")})
# context parallelism on the TE spec's grouped experts (Megatron's local attention has no CP): CP=2,
# each rank its tokens of every sequence by Megatron's load-balanced split, against one process on the
# same weights and micro-batches; both with whole loss masks and Megatron-LM's loss (pretrain_gpt's:
# the masked sum and the token count, tests/stats/te_cp_stats_worker.py), as the dense CP test has them
WHOLE = dict(whole_mask=True)
LAYOUTS.update({"temoe_whole": (1, 1, "global", dict(MOE, te=True, **WHOLE), None),
                "temoe_cp2": (1, 1, "global", dict(MOE, te=True, cp=2, **WHOLE), None)})
DP2_STEP = 4
"""Micro-batches in the step of a layout with data-parallel replicas, dealt as Megatron's sampler
deals them (replica r of D: the step's micro-batches r, r + D, ...)."""


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
    """Sequence parallelism's reduce-scatter, and a recomputed MoE router, ask for
    torch.cuda.current_device() in the backward, where the CPU shim's TorchFunctionMode (which maps
    the shim's 0 to the CPU) is not active: report the CPU device itself while such a layout runs."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def build(tp=1, pp=1, seed=1234, reinit=True, ep=1, etp=None, vpp=None, layers=None, te=False, cp=1, **overrides):
    """This rank's model chunks of a layout: Megatron's local spec, or with `te` its TE spec with
    grouped experts (over the TE double)."""
    from snip_megatron.megatron.model import build_model_chunks

    runtime.initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, seed=seed, ep=ep, etp=etp, cp=cp)
    runtime.seed_all(seed)
    if ep > 1 or etp is not None:
        overrides.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp)
    if cp > 1:
        overrides.update(context_parallel_size=cp)
    if te:
        from tests.pretrain.pretrain_worker import use_the_doubles_gpu
        from tests.stats.te_moe_stats_worker import build_te_moe

        if not use_the_doubles_gpu():
            raise RuntimeError("a TE layout runs over tests/te_double (put it on PYTHONPATH)")
        chunks = [build_te_moe(moe={}, **overrides)]
    else:
        with sp_tolerant_norms() if overrides.get("sequence_parallel") else contextlib.nullcontext():
            chunks = build_model_chunks(SHAPE.with_(num_layers=layers or SHAPE.num_layers), backend="local", **overrides)
    if reinit == "global":
        draw_by_global_name(chunks)
        return chunks
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


def draw_by_global_name(chunks) -> None:
    """Every matrix re-drawn whole from its global name (layer number, global expert id) and cut
    as Megatron shards it: TP (ETP for experts) rank r holds rows (column-parallel; a gated fc1:
    rows r of its gate and of its up half) or columns (row-parallel) r of tp equal slices. So any
    layout of TP, ETP, EP and PP computes the model one process computes."""
    import re

    from megatron.core import parallel_state as ps

    config = chunks[0].config

    def global_name(prefix, name):
        """A decoder layer's parameter under its layer number, an MTP layer's under its own path;
        a local expert's under its global expert id; a TE grouped expert's
        `experts.linear_fc1.weight<i>` as SequentialMLP's `experts.local_experts.<i>.linear_fc1.weight`."""
        grouped = re.fullmatch(r"(.*\.experts\.)(linear_fc\d)\.weight(\d+)", name)
        if grouped:
            name = f"{grouped.group(1)}local_experts.{grouped.group(3)}.{grouped.group(2)}.weight"
        m = re.search(r"local_experts\.(\d+)\.", name)
        if m is None:
            return f"{prefix}{name}"
        first = ps.get_expert_model_parallel_rank() * (config.num_moe_experts // ps.get_expert_model_parallel_world_size())
        return f"{prefix}{name[:m.start(1)]}{first + int(m.group(1))}{name[m.end(1):]}"

    gated = config.gated_linear_unit
    for chunk in chunks:
        named = [(global_name("", n), n, p) for n, p in chunk.named_parameters() if not n.startswith("decoder.layers")]
        for layer in chunk.decoder.layers:
            named += [(global_name(f"{layer.layer_number}.", n), n, p) for n, p in layer.named_parameters()]
        for name, local_name, p in named:
            if p.dim() != 2:
                continue
            expert = "mlp.experts." in local_name
            sharded = getattr(p, "tensor_model_parallel", False)
            size = (ps.get_expert_tensor_parallel_world_size() if expert else
                    ps.get_tensor_model_parallel_world_size()) if sharded else 1
            rank = (ps.get_expert_tensor_parallel_rank() if expert else
                    ps.get_tensor_model_parallel_rank()) if sharded else 0
            dim = getattr(p, "partition_dim", 0) if sharded else 0
            full = list(p.shape)
            full[dim] *= size
            g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + p.numel() * size)
            w = torch.randn(full, generator=g) * 0.05
            halves = 2 if gated and re.search(r"linear_fc1\.weight\d*$", local_name) else 1
            w = torch.cat([h.chunk(size, dim)[rank] for h in w.chunk(halves, 0)], 0)
            with torch.no_grad():
                p.copy_(w)


def padded_blockwise_error_fn():
    """blockwise_error_fn on operands zero-padded to whole blocks along the contraction dim: an
    expert's wgrad operands contract over its routed rows, any number of them (zeros change no
    block's amax, so the error of every real element is the unpadded block's)."""
    from snip_megatron.stats.quant_error import blockwise_error_fn

    inner = blockwise_error_fn()

    def error(t, precision, role, group=None, shard=(0, 1, 1)):
        contract_last = role in ("fprop_input", "fprop_weight", "dgrad_grad_output")
        dim = 1 if contract_last else 0
        pad = -t.shape[dim] % 16
        if not pad:
            return inner(t, precision, role, group, shard)
        shape = list(t.shape)
        shape[dim] = pad
        e = inner(torch.cat([t, t.new_zeros(shape)], dim), precision, role, group, shard)
        return e.narrow(dim, 0, t.shape[dim])

    return error


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


def megatron_lm_forward_step():
    """Megatron-LM's forward step: its loss is (the masked sum, the token count, the report),
    which Megatron's schedule divides by the count (megatron/core/pipeline_parallel/schedules.py:
    329-335); a (mean, report) loss it would multiply by CP (schedules.py:337-341)."""
    from tests.stats.te_cp_stats_worker import forward_step

    return forward_step


def measure_layout(name: str):
    """Build the model of layout `name`, measure one step, tear the parallel state down."""
    from megatron.core import parallel_state as ps

    from snip_megatron.megatron.batch import make_forward_step
    from snip_megatron.stats.config import MeasureConfig
    from snip_megatron.stats.measure import measure_chunks
    from snip_megatron.stats.quant_error import blockwise_error_fn

    # "<layout>_lone": a step of one micro-batch of 4, whose noise pass runs its two halves
    base, lone = (name[:-5], True) if name.endswith("_lone") else (name, False)
    tp, pp, megatron_init, overrides, k = LAYOUTS[base]
    overrides = dict(overrides)
    stride = overrides.pop("error_stride", None)
    whole_mask = overrides.pop("whole_mask", False)
    strides = dict(error_token_stride=stride, grad_error_token_stride=stride) if stride else {}
    chunks = build(tp, pp, reinit="global" if megatron_init == "global" else not megatron_init, **overrides)
    data, mbs = (batches(num=1, mbs=4), 4) if lone else (batches(), 2)
    replicas = ps.get_data_parallel_world_size()  # each data-parallel replica its share of DP2_STEP
    if replicas > 1 or base in ("single4", "pair", "moe_single4"):
        data = batches(num=DP2_STEP)[ps.get_data_parallel_rank()::replicas]
        if base == "pair":
            data = data[2:]
    if whole_mask:
        data = [dict(b, loss_mask=torch.ones_like(b["loss_mask"])) for b in data]
    if ps.get_context_parallel_world_size() > 1:  # this rank's tokens (Megatron-LM's get_batch)
        from megatron.core.utils import get_batch_on_this_cp_rank

        data = [get_batch_on_this_cp_rank(dict(b), is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())
                for b in data]
    try:
        # (a recomputed MoE layer's router asks for the current device inside the backward too)
        backward_device = overrides.get("sequence_parallel") or "ep" in overrides or "etp" in overrides or \
            ("num_moe_experts" in overrides and "recompute_granularity" in overrides)
        config = MeasureConfig(noise_frac=0.05, micro_batches=k, **strides)
        with cpu_current_device() if backward_device else contextlib.nullcontext():
            return measure_chunks(chunks, megatron_lm_forward_step() if whole_mask else make_forward_step(), data,
                                  seq_length=SHAPE.seq_length,
                                  micro_batch_size=mbs, config=config,
                                  error_fn=padded_blockwise_error_fn() if "num_moe_experts" in overrides
                                  else blockwise_error_fn())
    finally:
        runtime.destroy()


if __name__ == "__main__":
    main()
