"""megatron.moe.moe_refusals: the one owner of what an MoE run cannot do with SNIP, read by
Megatron-LM's loop, the compact loop and Bridge."""

from types import SimpleNamespace

from snip_megatron.megatron.moe import moe_refusals


def args(**kw):
    return SimpleNamespace(**{"world_size": 1, "transformer_impl": "local", **kw})


def flags(**kw):
    return [line.split(":")[0] for line in moe_refusals(args(**kw))]


def test_the_local_spec_runs_at_expert_pipeline_and_data_parallelism():
    assert flags() == []
    assert flags(world_size=4, expert_model_parallel_size=2, pipeline_model_parallel_size=2) == []


def test_te_grouped_experts_run_at_expert_tp_1_only():
    te = dict(transformer_impl="transformer_engine", moe_grouped_gemm=True)
    assert flags(**te) == []
    assert flags(**te, world_size=2, expert_model_parallel_size=2) == []
    assert flags(**te, world_size=2, pipeline_model_parallel_size=2) == []
    assert flags(**te, world_size=2, tensor_model_parallel_size=2, sequence_parallel=True,
                 expert_model_parallel_size=2, expert_tensor_parallel_size=1) == []
    # Megatron's default expert TP is TP
    assert flags(**te, world_size=2, tensor_model_parallel_size=2, sequence_parallel=True) == [
        "--expert-tensor-parallel-size 2 with --transformer-impl transformer_engine experts on 2 processes"]
    assert flags(transformer_impl="transformer_engine") == [
        "--num-experts with --transformer-impl transformer_engine without --moe-grouped-gemm"]


def test_tensor_parallelism_is_refused_on_the_local_spec_only():
    assert flags(world_size=2, tensor_model_parallel_size=2, sequence_parallel=True) == [
        "--tensor-model-parallel-size > 1 with --num-experts on --transformer-impl local"]
