"""The layout command: every rank's planned linears without allocating weights."""

from __future__ import annotations

import pytest

from snip_megatron.cli.layout import main
from snip_megatron.megatron.layout import (check_ownership, enumerate_layout, module_path,
                                           random_plan, roundtrip_plan)
from snip_megatron.plan import LayerKey
from snip_megatron.shapes import get_shape


def result_line(capsys) -> dict:
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    return dict(kv.split("=") for kv in last.split()[1:])


@pytest.mark.parametrize("argv, layers, ranks", [
    (["--model", "llama_70b", "--tp", "8", "--pp", "8"], 320, 64),
    (["--model", "llama_70b", "--tp", "8", "--pp", "8", "--vpp", "5"], 320, 64),
    (["--model", "llama_tiny"], 24, 1),
    (["--model", "llama_tiny", "--tp", "2", "--pp", "3", "--dp", "2"], 24, 12),
    (["--recipe"], 24, 1),  # the tiny recipe (configs/config.yaml defaults)
    (["--recipe", "parallel=tp2_pp2_dp2"], 24, 8),
    (["--recipe", "model=llama_70b", "parallel=tp8_pp8_vpp2"], 320, 64),
])
def test_layout_command(capsys, argv, layers, ranks):
    assert main(argv) == 0
    result = result_line(capsys)
    assert result["layers"] == str(layers) and result["ranks"] == str(ranks) and result["ok"] == "1"
    assert float(result["seconds"]) < 60


def test_70b_stages_and_shards():
    shape = get_shape("llama_70b")
    ranks = enumerate_layout(shape, tp=8, pp=8)
    assert [r.rank for r in ranks] == list(range(64))
    last = ranks[63]
    assert (last.tp_rank, last.pp_rank, last.layer_offsets) == (7, 7, (70,))
    first_of_last = last.linears[0]
    assert first_of_last.key == LayerKey(71, "linear_qkv")
    assert first_of_last.module_path == "decoder.layers.0.self_attention.linear_qkv"
    # GQA: (64 + 2*8) heads x 128 = 10240 qkv rows, split over 8 TP ranks; fc1 is gate+up.
    shapes = {s.key.name: s.local_shape for s in last.linears[:4]}
    assert shapes == {"linear_qkv": (1280, 8192), "linear_proj": (8192, 1024),
                      "linear_fc1": (7168, 8192), "linear_fc2": (8192, 3584)}


def test_vpp_interleaves_chunks_like_megatron():
    # Megatron's docstring example: 8 layers, 2 stages, 2 virtual stages ->
    # stage 0: [0, 1] [4, 5]; stage 1: [2, 3] [6, 7] (0-based).
    from snip_megatron.shapes import ModelShape

    shape = ModelShape(num_layers=8, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2)
    ranks = enumerate_layout(shape, pp=2, vpp=2)
    layers = [[sorted({s.key.layer - 1 for s in r.linears if s.chunk == c}) for c in (0, 1)]
              for r in ranks]
    assert layers == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert {s.module_path for s in ranks[1].linears if s.key.layer == 7} == {
        module_path(0, n) for n in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")}


def test_ownership_check_catches_a_doubly_owned_layer():
    shape = get_shape("llama_tiny")
    ranks = enumerate_layout(shape, pp=2, tp=2)
    check_ownership(shape, ranks, tp=2)
    broken = [r if r.pp_rank == 0 else r.__class__(**{**r.__dict__, "linears": r.linears + ranks[0].linears[:1]})
              for r in ranks]
    with pytest.raises(ValueError, match="1.linear_qkv is owned by 2 pipeline chunks"):
        check_ownership(shape, broken, tp=2)
    with pytest.raises(ValueError, match=r"on TP ranks \[0\], expected all of 0..1"):
        check_ownership(shape, [r for r in ranks if not (r.pp_rank == 1 and r.tp_rank == 1)], tp=2)


def test_roundtrip_recovers_the_plan_from_the_matchers():
    shape = get_shape("llama_tiny")
    ranks = enumerate_layout(shape, pp=3, tp=2)
    plan = random_plan(shape.num_layers, seed=3)
    assert roundtrip_plan(plan, ranks) == plan
    assert len(set(plan.values())) == 3  # the random plan exercises every precision


@pytest.mark.parametrize("argv, words", [
    (["--model", "llama_70b", "--tp", "16"], "num_query_groups=8 is not divisible by tensor_model_parallel_size=16"),
    (["--model", "llama_70b", "--pp", "3"], "num_layers=80 is not divisible by pipeline_model_parallel_size=3"),
    (["--model", "llama_tiny", "--vpp", "2"], "needs pipeline_model_parallel_size >= 2"),
    (["--model", "llama_9000b"], "unknown model 'llama_9000b'"),
    (["--recipe", "--tp", "2"], "--tp cannot be combined with --recipe"),
    (["--recipe", "model=llama_9000b"], "cannot compose recipe"),
])
def test_bad_layouts_are_refused(argv, words):
    with pytest.raises(ValueError, match=words):
        main(argv)


@pytest.mark.launches
def test_module_entry_point_prints_result_last():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "snip_megatron.cli.layout",
                           "--model", "llama_70b", "--tp", "8", "--pp", "8"],
                          capture_output=True, text=True, timeout=120, check=True)
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT layers=320 ranks=64 seconds=") and lines[-1].endswith(" ok=1")
    assert sum(line.startswith("rank ") for line in lines) == 64


@pytest.mark.parametrize("pp, vpp", [(8, None), (8, 5), (4, 2)])
def test_planner_stage_map_agrees_with_megatron_split(pp, vpp):
    """The planner's per-stage budgets use its own copy of Megatron's split; check it here."""
    from snip_megatron.planner.flops import stage_of_layers

    shape = get_shape("llama_70b")
    ranks = enumerate_layout(shape, tp=1, pp=pp, vpp=vpp)
    megatron = {s.key.layer: r.pp_rank for r in ranks for s in r.linears}
    assert stage_of_layers(shape.num_layers, pp, vpp) == megatron


def test_a_custom_pipeline_layout_places_every_rank_as_its_layout_says():
    """--pipeline-model-parallel-layout (DeepSeek-V3's recipes use one): each pipeline rank's layers,
    per virtual chunk in the interleaved order, as the layout lists them (Megatron computes a layout's
    offset for the calling rank only; SNIP's stage map is every rank's), MTP on the rank that holds
    it, read without any process group."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from snip_megatron.megatron.layout import chunk_layers, pipeline_stages

    layout = [["embedding", "decoder"], ["decoder", "decoder"], ["decoder"], ["decoder", "decoder"],
              ["decoder", "decoder"], ["decoder"], ["decoder"], ["mtp", "loss"]]  # pp=4 x vpp=2, model order
    config = TransformerConfig(num_layers=10, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=4,
                               virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_layout=layout,
                               mtp_num_layers=1, pipeline_dtype=__import__("torch").float32)
    # the list is in the model's order: vp stage 0 of ranks 0..3, then vp stage 1 (Megatron's
    # PipelineParallelLayerLayout reads layout[vpp_rank * pp + pp_rank] for (pp_rank, vpp_rank))
    chunks = {(rank, vp): layout[vp * 4 + rank] for rank in range(4) for vp in range(2)}
    expected, layer = {}, 0
    for vp in range(2):
        for rank in range(4):
            count = chunks[rank, vp].count("decoder")
            assert chunk_layers(config, rank, vp) == (layer, count), (rank, vp)
            expected.update({layer + i + 1: rank for i in range(count)})
            layer += count
    stages = pipeline_stages(config)
    assert {k.layer: s for k, s in stages.items() if not k.name.startswith("mtp.")} == expected
    assert {s for k, s in stages.items() if k.name.startswith("mtp.")} == {3}
