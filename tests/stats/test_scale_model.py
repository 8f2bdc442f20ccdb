"""The measurement's cost model reads its block sizes off the code and behaves as the code does."""

import pytest

from snip_megatron.shapes import get_shape
from snip_megatron.stats import adam, noise, scale_model as sm, table, tokens, weights


def test_constants_are_the_code_s():
    assert sm.NOISE_CHUNK == noise.CHUNK_ELEMS and sm.BLOCK_ELEMS == tokens.BLOCK_ELEMS == adam.BLOCK
    assert sm.WEIGHT_BLOCK_ELEMS == weights.MAX_BLOCK_ELEMS and sm.BLOCK_ROWS == weights.BLOCK_ROWS
    assert sm.TOKEN_CHUNK == tokens.TOKEN_CHUNK and sm.FIELDS == len(table.field_names())
    for n, stride in ((4096, 4), (1000, 8), (40, 4)):
        assert sm._kept(n, stride) == tokens.sample_rows(n, stride).kept
    for n in (100, 128, 147, 256):  # the backward-noise hook's sample: at least two chunks
        assert sm._kept_min(n, 4, 2) == tokens.sample_rows(n, 4, min_chunks=2).kept
    assert sm._kept_min(100, 4, 2) < 100 and sm._kept_min(64, 4, 2) == 64
    assert sm._block_rows(7168, 8192) == weights.block_rows(7168, 8192)


def _70b(**kw):
    base = dict(shape=get_shape("llama_70b"), tp=8, pp=8, sequence_parallel=True, recompute="full",
                micro_batch_size=1, global_batch=1024)
    return sm.MeasureLayout(**{**base, **kw})


def test_memory_and_compute_follow_the_layout():
    full = sm.memory(_70b())
    assert full["held"] == 0 and full["extra_over_training"] == full["extra_over_frozen_pass"]
    none = sm.memory(_70b(recompute="none"))
    assert none["held"] == none["in_flight"] * none["held_per_microbatch"] > 0 and none["in_flight"] == 8
    # measuring every micro-batch costs K/M more passes; the memory per rank does not grow
    every = _70b(micro_batches=None)
    assert sm.memory(every)["extra_over_training"] == full["extra_over_training"]
    assert sm.flops(every)["step_equiv"] > 50 * sm.flops(_70b())["step_equiv"]
    assert sm.flops(_70b())["measured_microbatches"] == 8 and sm.flops(every)["microbatches"] == 1024
    # sequence parallelism gathers the token-sharded operand in the hook
    assert sm.clean_hook_bytes(_70b(), "linear_fc1") > sm.clean_hook_bytes(_70b(sequence_parallel=False), "linear_fc1")


def test_an_moe_layout_counts_its_local_experts_on_their_routed_rows():
    """EP=4 over 8 experts top-2, TP=2 with SP: each rank holds 2 experts per MoE layer; an expert's
    hooks see its routed rows (the EP group's SP-sharded tokens x top-k over the experts), one expert
    at a time; its held inputs count every local expert; an expert's AdamW shard is the expert-data-
    parallel group's; Megatron's dispatcher syncs once per MoE layer forward in each pass."""
    from snip_megatron.models.gpt import MoEDims

    moe = MoEDims(num_experts=8, topk=2, ffn_hidden_size=256, layer_freq=2)
    shape = get_shape("llama_tiny").with_(num_layers=4, seq_length=1024)
    lay = sm.MeasureLayout(shape=shape, moe=moe, tp=2, dp=4, ep=4, sequence_parallel=True, micro_batch_size=2,
                           global_batch=64, recompute="none", distributed_optimizer=True)
    assert lay.local_experts == 2 and lay.expert_tokens == (2048 // 2) * 2 * 4 // 8
    assert len(lay.inventory) == 2 * 4 + 2 * 4  # layers 1, 3 MoE (attention + 2 expert units), 2, 4 dense
    assert lay.stage_layers() == {"moe": 2, "dense": 2, "mtp": 0}
    copies = lay.copies()
    assert copies["expert_fc1"] == 2 * 2 and copies["linear_fc1"] == 2 and copies["linear_qkv"] == 4
    view = lay.view("expert_fc1")
    assert view.tokens == lay.expert_tokens and not view.sequence_parallel and lay.view("linear_qkv") is lay
    rows, cols, kx, my = lay.linears()["expert_fc1"]
    assert (rows, cols) == (2 * 256, 128)  # one expert's (gate and up), not sharded at ETP=1
    dense_only = sm.MeasureLayout(**{**{f: getattr(lay, f) for f in ("shape", "tp", "dp", "sequence_parallel",
                                                                      "micro_batch_size", "global_batch")}})
    assert sm.held_bytes(lay) - sm.held_bytes(dense_only) == 2 * (
        2 * lay.expert_tokens * (128 + 256) - lay.tokens // 2 * 128 - lay.tokens * 352 // 2) * 2
    edp = 2 * 4 // 4  # tp x dp / (etp x ep)
    assert sm.adam_bytes(lay) == 5 * 8 * (512 * 128 // edp)  # the largest shard: one expert's fc1 over EDP=2
    assert sm.dispatcher_syncs(lay) == sm.measurement_passes(lay) * lay.measured * 2 and sm.dispatcher_syncs(dense_only) == 0
    # EP=4 is wider than TP=2 (its expert groups span data-parallel replicas): every replica measures
    # alike, so no noise interleaving; a forward- and a backward-noise pass (measure.py `spans`)
    assert lay.spans and sm.measurement_passes(lay) == 3
    assert sm.memory(lay)["persistent"] == (len(lay.inventory) + 1) * (sm.FIELDS * 50 + 16)
    with pytest.raises(ValueError, match="ep=3"):
        sm.MeasureLayout(shape=shape, moe=moe, ep=3, tp=1, dp=3, global_batch=3)


def test_context_parallel_hooks_take_the_micro_batch_s_tokens_gathered():
    """CP=2 holds half a micro-batch's tokens per rank; the hooks gather X and G_Y over CP and take
    their samples, errors and Grams on the whole micro-batch's, as one CP=1 rank does."""
    one, cp2 = _70b(sequence_parallel=False), _70b(sequence_parallel=False, cp=2)
    assert 2 * cp2.tokens == one.tokens
    for name in ("linear_qkv", "linear_fc2"):
        rows_w, cols_w, kx, my = one.linears()[name]
        gathered = sm._gathered(cp2, cp2.tokens, kx, my, cp2.column(name))
        assert gathered == 2 * (2 * cp2.tokens * (kx + my) + cp2.tokens * max(kx, my))  # BF16
        a, b = sm.clean_hook_phases(one, name), sm.clean_hook_phases(cp2, name)
        assert b["grams"] - gathered == a["grams"] and b["weights"] - gathered == a["weights"]
    half = _70b(sequence_parallel=False, seq_length=one.seq // 2)  # a rank's tokens at CP=2, not gathered
    assert half.tokens == cp2.tokens and sm.flops(cp2)["measure_flops"] > sm.flops(half)["measure_flops"]
