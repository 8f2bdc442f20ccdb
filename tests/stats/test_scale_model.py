"""The measurement's cost model reads its block sizes off the code and behaves as the code does."""

from snip_megatron.shapes import get_shape
from snip_megatron.stats import adam, noise, scale_model as sm, table, tokens, weights


def test_constants_are_the_code_s():
    assert sm.NOISE_CHUNK == noise.CHUNK_ELEMS and sm.BLOCK_ELEMS == tokens.BLOCK_ELEMS == adam.BLOCK
    assert sm.WEIGHT_BLOCK_ELEMS == weights.MAX_BLOCK_ELEMS and sm.BLOCK_ROWS == weights.BLOCK_ROWS
    assert sm.TOKEN_CHUNK == tokens.TOKEN_CHUNK and sm.FIELDS == len(table.field_names())
    for n, stride in ((4096, 4), (1000, 8), (40, 4)):
        assert sm._kept(n, stride) == tokens.sample_rows(n, stride).kept
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
