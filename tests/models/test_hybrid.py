"""The HybridModel adapter: pattern parsing, pipeline segments and module names checked against
Megatron's own (megatron.core.models.hybrid, absent in the compat lane's megatron-core), and
shapes. The 70B-class pattern's planning time is tests/bench/test_planner_scale.py's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from snip_megatron.models import gpt, gpt_spec, hybrid
from snip_megatron.models.inventory import ParallelKind
from snip_megatron.models.keys import LayerKey
from snip_megatron.models.order import forward_order
from snip_megatron.plan import Plan
from snip_megatron.shapes import get_shape

TINY = get_shape("llama_tiny")


def test_a_gpt_block_is_an_attention_layer_then_an_mlp_layer():
    inv = hybrid.inventory(TINY.with_(num_layers=4), "*-*-")
    assert [str(k) for k in inv.keys()] == ["1.linear_qkv", "1.linear_proj", "2.linear_fc1", "2.linear_fc2",
                                           "3.linear_qkv", "3.linear_proj", "4.linear_fc1", "4.linear_fc2"]
    dense = gpt.inventory(TINY.with_(num_layers=2))
    # GPT layer L is hybrid layers 2L-1 (attention) and 2L (MLP): same shapes, kinds and suffixes
    assert [(e.shape, e.kind, e.suffix) for e in inv] == [(e.shape, e.kind, e.suffix) for e in dense]
    assert list(inv.keys()) == sorted(inv.keys(), key=forward_order)


def test_mamba_and_gdn_layers_and_their_shapes():
    shape = TINY.with_(num_layers=4, hidden_size=4096, num_attention_heads=32, num_query_groups=8)
    inv = hybrid.inventory(shape, "M*G-")
    assert [str(k) for k in inv.keys()][:2] == ["1.in_proj", "1.out_proj"]
    mamba_in = inv.entry("1.in_proj")
    # d_inner = 2 x 4096; in_proj packs z, x (2 d_inner), B, C (2 x 8 groups x 128 state), dt (8192 / 64 heads)
    assert mamba_in.shape == (2 * 8192 + 2 * 8 * 128 + 128, 4096) and mamba_in.suffix == "mixer.in_proj"
    assert inv.entry("1.out_proj").shape == (4096, 8192) and inv.entry("1.out_proj").kind is ParallelKind.ROW
    gdn_in = inv.entry("3.in_proj")
    assert gdn_in.suffix == "self_attention.in_proj" and gdn_in.shape == (2 * 2048 + 2 * 4096 + 64, 4096)
    assert list(inv.keys()) == sorted(inv.keys(), key=forward_order)
    plan = Plan.uniform(inv, "fp8")
    assert Plan.from_json(plan.to_json()) == plan and plan.to_dict()["version"] == 2


def test_an_moe_layer_plans_the_gpt_adapters_expert_units():
    """`*E*-`: layer 2's routed experts are one unit per linear (one expert's shape, all experts,
    top-k routed FLOPs), exactly the GPT adapter's for the same experts; shared experts when the
    config has them; the router is never planned."""
    moe = gpt.MoEDims(num_experts=4, topk=2, ffn_hidden_size=48)
    inv = hybrid.inventory(TINY.with_(num_layers=4), "*E*-", moe=moe)
    assert [str(k) for k in inv.keys()] == ["1.linear_qkv", "1.linear_proj", "2.expert_fc1", "2.expert_fc2",
                                           "3.linear_qkv", "3.linear_proj", "4.linear_fc1", "4.linear_fc2"]
    fc1, fc2 = inv.entry("2.expert_fc1"), inv.entry("2.expert_fc2")
    assert (fc1.suffix, fc1.shape, fc1.experts, fc1.topk) == \
        ("mlp.experts.linear_fc1", (2 * 48, TINY.hidden_size), 4, 2)
    assert fc1.flops_per_token == 6 * 2 * 48 * TINY.hidden_size * 2 and fc2.kind is ParallelKind.ROW
    as_gpt = gpt.inventory(TINY.with_(num_layers=2), moe=dataclasses.replace(moe, layer_freq=(1, 0)))
    assert [inv.entry(f"2.{n}") for n in ("expert_fc1", "expert_fc2")] == \
        [dataclasses.replace(as_gpt.entry(f"1.{n}"), key=LayerKey(2, n)) for n in ("expert_fc1", "expert_fc2")]
    assert gpt.MOE_ROUTER in inv.unplanned and list(inv.keys()) == sorted(inv.keys(), key=forward_order)
    # SP: the dispatcher hands experts whole tokens, never sequence-sharded
    assert not hybrid.inventory(TINY.with_(num_layers=4), "*E*-", moe=moe, sequence_parallel=True).entry(
        "2.expert_fc1").sp_shards_input
    shared = hybrid.inventory(TINY.with_(num_layers=2), "*E",
                              moe=dataclasses.replace(moe, shared_ffn_hidden_size=64, shared_gate=True))
    assert [str(k) for k in shared.keys()][2:] == ["2.expert_fc1", "2.expert_fc2", "2.shared_expert_fc1",
                                                   "2.shared_expert_fc2"]
    assert shared.entry("2.shared_expert_fc1").shape == (128, TINY.hidden_size)
    assert shared.entry("2.shared_expert_fc1").experts == 0 and gpt.SHARED_EXPERT_GATE in shared.unplanned
    assert hybrid.key_for_path("module.decoder.layers.1.mlp.experts.linear_fc1") == LayerKey(2, "expert_fc1")
    assert hybrid.key_for_path("decoder.layers.0.mlp.shared_experts.linear_fc2", 2) == LayerKey(3, "shared_expert_fc2")
    assert hybrid.key_for_path("decoder.layers.1.mlp.router") is None
    assert [hybrid.module_path(e) for e in inv][2:4] == ["decoder.layers.1.mlp.experts.linear_fc1",
                                                          "decoder.layers.1.mlp.experts.linear_fc2"]
    plan = Plan.uniform(inv, "fp8")
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match=r"MoE \(E\) layers but the model has no experts"):
        hybrid.inventory(TINY.with_(num_layers=4), "*E*-")


@pytest.mark.parametrize("pattern, words", [
("+-+-", r"multi-latent attention layers \(\+\)"),
    ("D-D-", r"sparse attention layers \(D\)"), ("*-*-/*-", "multi-token prediction"),
    ("*-X-", "unknown layer symbol.s. X"), ("||", "has no layers"),
])
def test_patterns_snip_cannot_plan_are_refused_by_name(pattern, words):
    with pytest.raises(ValueError, match=words):
        hybrid.parse_pattern(pattern)


def test_paths_and_keys_translate_both_ways():
    assert hybrid.key_for_path("decoder.layers.1.mixer.in_proj", 4) == LayerKey(6, "in_proj")
    assert hybrid.key_for_path("module.decoder.layers.0.self_attention.in_proj") == LayerKey(1, "in_proj")
    assert hybrid.key_for_path("decoder.layers.0.mixer.conv1d") is None
    inv = hybrid.inventory(get_shape("llama_tiny").with_(num_layers=8), "M*M*|MGM*")
    assert hybrid.module_path(inv.entry(LayerKey(6, "in_proj")), 4) == "decoder.layers.1.self_attention.in_proj"
    assert hybrid.module_path(inv.entry(LayerKey(5, "in_proj")), 4) == "decoder.layers.0.mixer.in_proj"
    assert [hybrid.key_for_path(hybrid.module_path(e, 4), 4) for e in inv if e.layer > 4] == \
        [e.key for e in inv if e.layer > 4]
    with pytest.raises(ValueError, match="not in a chunk starting after layer 4"):
        hybrid.module_path(inv.entry(LayerKey(3, "in_proj")), 4)


def test_pipeline_stages_of_each_layer():
    assert hybrid.stage_of_layers("*-|M*-|*|--", 2, 2) == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 0, 7: 1, 8: 1}
    assert hybrid.stage_of_layers("*-*-", 2) == {1: 0, 2: 0, 3: 1, 4: 1}
    with pytest.raises(ValueError, match="3 '.' segments, not a multiple of 2"):
        hybrid.stage_of_layers("*|-|*", 2)


def test_the_inventory_needs_the_patterns_layer_count():
    with pytest.raises(ValueError, match="num_layers=6 but --hybrid-layer-pattern '.-.-' has 4 layers"):
        hybrid.inventory(TINY, "*-*-")


SEGMENT_CASES = [("*-*-", 1, None), ("*-|*-", 2, None), ("*-*-*-*-", 2, None), ("M-M*-|M-M*-|M-|M*", 2, 2),
                 ("*-|*-*-|M|-", 4, None)]


@pytest.mark.parametrize("pattern, pp, vpp", SEGMENT_CASES)
def test_segments_are_megatrons(monkeypatch, pattern, pp, vpp):
    allocation = pytest.importorskip("megatron.core.models.hybrid.hybrid_layer_allocation")
    import torch.distributed as dist

    # Megatron logs the chosen segment on each stage through parallel state; no process group here
    monkeypatch.setattr(allocation, "log_on_each_pipeline_stage", lambda *a, **k: None)
    monkeypatch.setattr(allocation, "log_single_rank", lambda *a, **k: None)
    for pp_rank in range(pp):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=pp_rank: r)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: pp)
        for vp_stage in range(vpp) if vpp else [None]:
            symbols, offset = allocation.select_pipeline_segment(pattern, object() if pp > 1 else None, vp_stage)
            assert hybrid.segment(pattern, pp_rank, pp, vp_stage) == (offset, "".join(symbols))
            group = SimpleNamespace(rank=lambda r=pp_rank: r, size=lambda: pp) if pp > 1 else None
            assert hybrid.chunk_offset(pattern, group, vp_stage) == offset  # from the pipeline group
    assert hybrid.layer_symbols(pattern) == "".join(allocation.validate_segment_layers(pattern.replace("|", "")))


def test_module_names_are_those_of_megatrons_hybrid_spec():
    specs = pytest.importorskip("megatron.core.models.hybrid.hybrid_layer_specs")
    stack = specs.hybrid_stack_spec.submodules
    layer_of = {"*": stack.attention_layer, "-": stack.mlp_layer, "M": stack.mamba_layer, "G": stack.gdn_layer,
                "E": stack.moe_layer}
    for symbol, slots in hybrid.LINEARS.items():
        for slot in slots:
            if slot in gpt.LATENT_LINEARS:  # MoELayer builds these as TELinear itself (moe_layer.py), not from the spec
                continue
            assert gpt_spec.spec_linear_class(layer_of[symbol], slot.suffix) is not None, (symbol, slot.suffix)


def _fake_hybrid_stage(pattern: str, pp_rank: int, pp: int, *, tp: int = 1):
    """A module tree with a built HybridModel chunk's names (a stand-in: Megatron's hybrid spec is
    TE-only, so the built model runs in tests/stats/test_measure_hybrid.py over the TE double)."""
    import torch

    config = SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)

    class Linear(torch.nn.Linear):
        def __init__(self, out_f, in_f):
            super().__init__(in_f, out_f, bias=False)
            self.config = config

        def finish_init(self, quant_config):  # what makes Megatron's finish loop reach a module
            pass

    shapes = hybrid.linear_shapes(TINY.with_(num_layers=len(hybrid.layer_symbols(pattern))))
    layers = torch.nn.ModuleList()
    offset, symbols = hybrid.segment(pattern, pp_rank, pp)
    for i, symbol in enumerate(symbols):
        layer = torch.nn.Module()
        layer.layer_number = offset + i + 1
        for slot in hybrid.LINEARS[symbol]:
            parent, leaf = slot.suffix.split(".")
            if not hasattr(layer, parent):
                layer.add_module(parent, torch.nn.Module())
            out_f, in_f = shapes[symbol][slot.name]
            local = (out_f // tp, in_f) if slot.kind is ParallelKind.COLUMN else (out_f, in_f // tp)
            getattr(layer, parent).add_module(leaf, Linear(*local))
        layers.append(layer)
    model = torch.nn.Module()
    model.hybrid_layer_pattern = pattern
    model.decoder = torch.nn.Module()
    model.decoder.layers = layers
    model.output_layer = Linear(8, 8)  # takes a quant_recipe, never planned
    wrapper = torch.nn.Module()  # as DDP wraps it
    wrapper.module = model
    return wrapper


def test_discovery_from_built_chunks_keys_by_layer_number_with_the_stage_offset():
    from snip_megatron.models.inventory import merge
    from snip_megatron.models.registry import family_of

    pattern = "*-|*-"
    stages = [_fake_hybrid_stage(pattern, pp_rank, 2, tp=2) for pp_rank in (0, 1)]
    assert family_of(stages) == hybrid.FAMILY and hybrid.is_model(stages[1])
    parts = [hybrid.discover(stage) for stage in stages]
    assert [str(k) for k in parts[1].keys()] == ["3.linear_qkv", "3.linear_proj", "4.linear_fc1", "4.linear_fc2"]
    merged = merge(parts)
    # TP=2 shards: the whole shapes, and SP on the column-parallel linears, are the pattern's
    expected = hybrid.inventory(TINY.with_(num_layers=4), pattern, sequence_parallel=True)
    assert expected.difference(merged) is None
    assert any(u.path == "module.output_layer" for u in merged.unplanned)
    paths = [p for p, _, _ in hybrid.planned_modules(stages[1])]
    assert paths[0] == "module.decoder.layers.0.self_attention.linear_qkv"


def test_a_pattern_cut_in_more_segments_than_stages_is_interleaved_over_the_stages():
    """'*-|*-|*-|*-' at PP=2: four chunks, two per stage (Megatron-LM's virtual pipeline from the
    segments): chunk c on stage c % 2."""
    from snip_megatron.models import hybrid

    assert hybrid.stage_of_layers("*-|*-|*-|*-", 2) == {1: 0, 2: 0, 3: 1, 4: 1, 5: 0, 6: 0, 7: 1, 8: 1}
    assert hybrid.stage_of_layers("*-|*-", 2) == {1: 0, 2: 0, 3: 1, 4: 1}


def test_a_nemotron_style_mamba_moe_hybrid_is_enumerated_and_planned_from_its_pattern():
    """A Nemotron-H-style MoE hybrid (Mamba M, attention *, MoE E with 128 experts top-6 and a shared
    expert; 52 layers in 4 '|' segments): its planned linears come from the pattern alone (no model
    built: Mamba's kernels are CUDA-only, so CPU cannot build it), keyed by hybrid layer number, each
    stage's from its segment, and planned with a budget per stage."""
    from snip_megatron.planner import PlannerConfig, solve_plan, stages_for_keys

    segment = "MEMEM*EMEMEM*"
    pattern = "|".join([segment] * 4)
    shape = get_shape("llama_7b").with_(num_layers=52, hidden_size=2688, ffn_hidden_size=1856,
                                        num_attention_heads=32, num_query_groups=2)
    moe = gpt.MoEDims(num_experts=128, topk=6, ffn_hidden_size=1856, shared_ffn_hidden_size=3712)
    inv = hybrid.inventory(shape, pattern, hybrid.HybridDims(), moe=moe)
    kinds = {symbol: pattern.replace("|", "").count(symbol) for symbol in "ME*"}
    assert kinds == {"M": 24, "E": 20, "*": 8}
    names = [k.name for k in inv.keys()]
    assert names.count("in_proj") == 24 and names.count("expert_fc1") == 20 and names.count("linear_qkv") == 8
    assert names.count("shared_expert_fc2") == 20 and len(inv) == 2 * 24 + 4 * 20 + 2 * 8
    first_moe = next(e for e in inv if e.key.name == "expert_fc1")
    assert (first_moe.key.layer, first_moe.experts, first_moe.topk) == (2, 128, 6)
    stage_of = hybrid.stage_of_layers(pattern, 4)
    assert {stage_of[layer] for layer in range(1, 14)} == {0} and stage_of[52] == 3
    costs = {k: {p: (0.0 if p.value == "bf16" else (1.0 if p.value == "fp4" else 0.1)) * (1 + k.layer % 5)
                 for p in gpt_precisions()} for k in inv.keys()}
    result = solve_plan(costs, inv.flop_table(4096), PlannerConfig(rho=0.75, solver="exact"),
                        stages=stages_for_keys(costs, stage_of))
    assert set(result.plan) == set(inv.keys())
    assert min(a.fp4_fraction for a in result.per_stage.values()) >= 0.75 - 1e-6


def gpt_precisions():
    from snip_megatron.formats.precision import Precision

    return (Precision.BF16, Precision.FP8, Precision.FP4)
