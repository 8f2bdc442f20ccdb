"""The dense-GPT adapter: the inventory from a shape equals the one discovered from a built model."""

from __future__ import annotations

import time

import pytest

from snip_megatron.models import gpt
from snip_megatron.models.keys import LayerKey
from snip_megatron.plan import all_keys
from snip_megatron.shapes import PRESETS, get_shape


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_inventory_of_every_preset_lists_todays_keys_in_order(preset):
    shape = get_shape(preset)
    inv = gpt.inventory(shape)
    assert list(inv.keys()) == all_keys(shape.num_layers)
    assert {e.key.name: e.shape for e in inv if e.layer == 1} == gpt.linear_shapes(shape)


def test_the_70b_layout_enumerates_without_weights_in_milliseconds():
    start = time.perf_counter()
    inv = gpt.inventory(get_shape("llama_70b"))
    assert time.perf_counter() - start < 0.5
    assert len(inv) == 320 and inv.entry("80.linear_fc1").shape == (2 * 28672, 8192)


def test_paths_and_keys_translate_both_ways():
    assert gpt.key_for_path("decoder.layers.2.mlp.linear_fc1", 10) == LayerKey(13, "linear_fc1")
    assert gpt.key_for_path("module.decoder.layers.0.self_attention.linear_qkv") == LayerKey(1, "linear_qkv")
    assert gpt.key_for_path("decoder.layers.0.mlp.router") is None
    # multi-token prediction: keys of their own, by depth, whatever the chunk's offset (0.16 and 0.19 names)
    assert gpt.key_for_path("mtp.layers.0.transformer_layer.mlp.linear_fc1", 10) == LayerKey(1, "mtp.linear_fc1")
    assert gpt.key_for_path("module.mtp.layers.1.mtp_model_layer.self_attention.linear_qkv") == \
        LayerKey(2, "mtp.linear_qkv")
    assert gpt.key_for_path("mtp.layers.0.eh_proj", 3) == LayerKey(1, "mtp.eh_proj")
    assert gpt.module_path(LayerKey(1, "mtp.linear_proj")) == "mtp.layers.0.mtp_model_layer.self_attention.linear_proj"
    assert gpt.module_path(LayerKey(13, "linear_fc1"), 10) == "decoder.layers.2.mlp.linear_fc1"
    assert gpt.layer_path("module.decoder.layers.3.mlp.linear_fc2") == "module.decoder.layers.3"
    with pytest.raises(ValueError, match="not a planned linear of a GPT chunk"):
        gpt.module_path(LayerKey(3, "linear_fc1"), 5)


@pytest.mark.compat
@pytest.mark.parametrize("backend", ["emulated", "local"])
def test_discovered_from_the_built_model_equals_the_one_from_its_shape(megatron_single, backend):
    from snip_megatron.megatron.model import build_model_chunks
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape
    from snip_megatron.models.agree import agree

    chunks = build_model_chunks(shape, backend=backend)
    found = gpt.discover(chunks)
    if backend == "local":  # Megatron's plain linears take no quant_recipe: nothing to plan
        assert len(found) == 0
        return
    assert found == gpt.inventory(shape)
    assert agree(found, expected=gpt.inventory(shape)) == found
    with pytest.raises(ValueError, match="does not match the model built on these ranks"):
        agree(found, expected=gpt.inventory(shape.with_(num_layers=shape.num_layers + 1)))


@pytest.mark.launches
def test_the_adapter_and_the_inventory_import_no_megatron_nor_torch():
    import subprocess
    import sys

    code = ("import sys, snip_megatron.models.gpt, snip_megatron.models.agree; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_only_the_adapter_names_the_gpt_linears_in_code():
    """Outside models/gpt.py (and its layer-spec part, models/gpt_spec.py) no code uses a GPT linear's name as a value or an attribute (docstrings
    and messages may mention them)."""
    import ast
    from pathlib import Path

    package = Path(gpt.__file__).resolve().parents[1]
    names = set(gpt.NAMES)  # the dense layer's and multi-latent attention's
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.parent == Path(gpt.__file__).resolve().parent and path.name in ("gpt.py", "gpt_spec.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(package)}:{node.lineno} {node.value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in names:
                found.append(f"{path.relative_to(package)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.keyword) and node.arg in names:
                found.append(f"{path.relative_to(package)}:{node.lineno} {node.arg}=")
    assert not found, "\n".join(found)


MLA = gpt.MLADims(q_lora_rank=32, kv_lora_rank=48, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16)


def test_multi_latent_attention_inventory_shapes_kinds_and_flops():
    import dataclasses

    shape = get_shape("llama_tiny")
    inv = gpt.inventory(shape, mla=MLA, sequence_parallel=True)
    n, h = shape.num_attention_heads, shape.hidden_size
    layer1 = {e.key.name: e for e in inv if e.layer == 1}
    assert list(layer1) == ["linear_q_down_proj", "linear_kv_down_proj", "linear_q_up_proj", "linear_kv_up_proj",
                            "linear_proj", "linear_fc1", "linear_fc2"]
    assert layer1["linear_q_down_proj"].shape == (32, h) and layer1["linear_kv_down_proj"].shape == (64, h)
    assert layer1["linear_q_up_proj"].shape == (n * 32, 32) and layer1["linear_kv_up_proj"].shape == (n * 32, 48)
    assert layer1["linear_proj"].shape == (h, n * 16)
    assert {k: e.kind.value for k, e in layer1.items() if "down" in k} == {"linear_q_down_proj": "duplicated",
                                                                          "linear_kv_down_proj": "duplicated"}
    assert layer1["linear_kv_down_proj"].sp_shards_input and not layer1["linear_proj"].sp_shards_input
    assert layer1["linear_kv_up_proj"].flops_per_token == 6 * n * 32 * 48
    no_q_lora = gpt.inventory(shape, mla=dataclasses.replace(MLA, q_lora_rank=None))
    assert [e.key.name for e in no_q_lora if e.layer == 1][0] == "linear_q_proj"
    assert gpt.key_for_path("decoder.layers.1.self_attention.linear_kv_up_proj", 4) == LayerKey(6, "linear_kv_up_proj")
    # a dense GPT's keys keep their order and seeds (v1 plans and digests unchanged)
    from snip_megatron.models.order import forward_order, key_index

    assert sorted(all_keys(2), key=forward_order) == all_keys(2)
    assert [key_index(k) for k in all_keys(1)] == [4, 5, 6, 7]


def test_an_mla_model_built_on_the_emulated_spec_holds_its_inventory(megatron_single):
    from megatron.core import package_info

    from snip_megatron.megatron.model import build_model_chunks
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape

    if package_info.__version__.startswith("0.16."):
        pytest.skip("megatron-core 0.16.1's MLASelfAttention cannot be built without Transformer Engine "
                    "(isinstance(linear_proj, TELinear) with TELinear None)")
    chunks = build_model_chunks(shape, backend="emulated", mla=MLA)
    found = gpt.discover(chunks)
    assert found == gpt.inventory(shape, mla=MLA) == gpt.of_config(chunks[0].config)
    assert {type(m).__name__ for p, m in chunks[0].named_modules() if p.endswith("down_proj")} == {"QuantDownProjection"}



@pytest.mark.compat
def test_an_mtp_model_built_on_the_emulated_spec_holds_its_inventory(megatron_single):
    """The MTP layer's inner transformer layer is named by release (gpt.MTP_INNER): its planned
    linears are found, keyed apart from the decoder's, and built as SNIP's emulated linears."""
    from snip_megatron.megatron.model import build_model_chunks
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape

    chunks = build_model_chunks(shape, backend="emulated", mtp_num_layers=1)
    found = gpt.discover(chunks)
    assert found == gpt.inventory(shape, mtp_num_layers=1) == gpt.of_config(chunks[0].config)
    mtp = {n: m for n, m in chunks[0].named_modules() if n.startswith("mtp.layers.0.") and n.endswith(
        ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "eh_proj"))}
    assert len(mtp) == 5 and all(callable(getattr(m, "set_precision", None)) for m in mtp.values()), list(mtp)
    assert {gpt.key_for_path(n, shape.num_layers) for n in mtp} == {e.key for e in found if gpt.is_mtp(e.key)}

def test_multi_token_prediction_keys_live_apart_from_the_decoder():
    from snip_megatron.models.inventory import Inventory, merge

    shape = get_shape("llama_tiny")
    inv = gpt.inventory(shape, mtp_num_layers=1)
    mtp = [e for e in inv if gpt.is_mtp(e.key)]
    assert [str(e.key) for e in mtp] == ["1.mtp.eh_proj", "1.mtp.linear_qkv", "1.mtp.linear_proj",
                                         "1.mtp.linear_fc1", "1.mtp.linear_fc2"]
    assert list(inv)[-5:] == mtp and mtp[0].shape == (shape.hidden_size, 2 * shape.hidden_size)
    assert inv.entry("1.linear_qkv").shape == inv.entry("1.mtp.linear_qkv").shape
    # the last pipeline stage holds the MTP layer, the first decoder layer 1: one global list
    first = Inventory("gpt", [e for e in inv if e.layer == 1 and not gpt.is_mtp(e.key)])
    last = Inventory("gpt", [e for e in inv if e.layer > 1 or gpt.is_mtp(e.key)])
    assert merge([last, first]) == inv


# -- MoE ------------------------------------------------------------------------------------------

MOE = gpt.MoEDims(num_experts=8, topk=2, ffn_hidden_size=96, shared_ffn_hidden_size=64, shared_gate=True,
                  layer_freq=(0, 1, 1, 0))


def test_moe_layers_hold_one_unit_per_expert_linear_and_their_flops_count_routed_tokens():
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape

    inv = gpt.inventory(shape, moe=MOE)
    names = inv.names_by_layer()
    dense, moe = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), \
        ("linear_qkv", "linear_proj", "expert_fc1", "expert_fc2", "shared_expert_fc1", "shared_expert_fc2")
    assert [names[layer] for layer in (1, 2, 3, 4)] == [dense, moe, moe, dense]
    fc1 = inv.entry("2.expert_fc1")
    assert fc1.shape == (2 * 96, shape.hidden_size) and fc1.experts == 8 and fc1.topk == 2
    assert fc1.suffix == "mlp.experts.linear_fc1"
    assert inv.entry("2.shared_expert_fc2").experts == 0 and inv.entry("2.shared_expert_fc2").shape == (shape.hidden_size, 64)
    # Megatron-LM's routed count: 4 * T * h * moe_ffn * topk * 3/2 (SwiGLU) forward, x3 for the backward
    tokens = 1000
    flops = inv.flop_table(tokens)
    megatron_routed_fwd = 4 * tokens * shape.hidden_size * 96 * 2 * 1.5
    assert flops[LayerKey(2, "expert_fc1")] + flops[LayerKey(2, "expert_fc2")] == 3 * megatron_routed_fwd
    # so an FP4 budget is the same fraction of linear FLOPs as on a dense model: the routed experts
    # weigh top-k experts' worth, not all eight
    assert flops[LayerKey(2, "expert_fc2")] == 2 * 6 * tokens * shape.hidden_size * 96
    # the router and the shared-expert gate are never planned, and say so
    paths = {u.path for u in inv.unplanned}
    assert {"decoder.layers.*.mlp.router", "decoder.layers.*.mlp.shared_experts.gate_weight"} <= paths
    assert "decoder.layers.*.mlp.router" not in {u.path for u in gpt.inventory(shape).unplanned}


def test_moe_layer_freq_as_megatron_reads_it():
    every_other = gpt.MoEDims(num_experts=4, topk=1, ffn_hidden_size=8, layer_freq=2)
    assert [every_other.is_moe_layer(layer, 4) for layer in (1, 2, 3, 4)] == [True, False, True, False]
    with pytest.raises(ValueError, match="moe_layer_freq lists 4 layers, the model has 6"):
        MOE.is_moe_layer(1, 6)


def test_local_expert_paths_are_their_units():
    path = "module.decoder.layers.1.mlp.experts.local_experts.3.linear_fc2"
    assert gpt.key_for_path(path, 4) == LayerKey(6, "expert_fc2") and gpt.expert_index(path) == 3
    assert gpt.key_for_path("decoder.layers.0.mlp.experts.linear_fc1") == LayerKey(1, "expert_fc1")
    assert gpt.expert_index("decoder.layers.0.mlp.experts.linear_fc1") is None
    assert gpt.key_for_path("decoder.layers.0.mlp.shared_experts.linear_fc1") == LayerKey(1, "shared_expert_fc1")
    assert gpt.key_for_path("decoder.layers.0.mlp.router") is None
    assert gpt.layer_path(path) == "module.decoder.layers.1"
    assert gpt.module_path(LayerKey(6, "expert_fc1"), 4) == "decoder.layers.1.mlp.experts.linear_fc1"


@pytest.mark.compat
def test_moe_inventory_discovered_from_the_emulated_model_equals_the_configs(megatron_single):
    from snip_megatron.megatron.model import build_model_chunks
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape

    chunks = build_model_chunks(shape, backend="emulated", num_moe_experts=4, moe_router_topk=2,
                                moe_ffn_hidden_size=32, moe_layer_freq=[1, 0, 0, 1],
                                moe_shared_expert_intermediate_size=32)
    found = gpt.discover(chunks)
    assert found == gpt.of_config(chunks[0].config)
    assert [e.key.name for e in found if e.layer == 4][2:] == ["expert_fc1", "expert_fc2", "shared_expert_fc1",
                                                            "shared_expert_fc2"]
    assert "decoder.layers.*.mlp.router" in {u.path for u in found.unplanned}
    # every local expert is SNIP's emulated linear
    experts = [m for n, m in chunks[0].named_modules() if ".local_experts." in n and n.endswith("linear_fc1")]
    assert len(experts) == 8 and all(callable(getattr(m, "set_precision", None)) for m in experts)


def test_an_expert_units_paths_and_glob_cover_the_grouped_module_and_every_local_expert():
    import fnmatch

    key = LayerKey(3, "expert_fc2")
    assert gpt.module_paths(key, 2) == ("decoder.layers.0.mlp.experts.linear_fc2",
                                        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2")
    glob = gpt.module_pattern(key, 2)
    for path in ("decoder.layers.0.mlp.experts.linear_fc2", "decoder.layers.0.mlp.experts.local_experts.7.linear_fc2"):
        assert fnmatch.fnmatch(path, glob)
    for path in ("decoder.layers.0.mlp.experts.local_experts.7.linear_fc1", "decoder.layers.0.mlp.shared_experts.linear_fc2",
                 "decoder.layers.10.mlp.experts.linear_fc2"):
        assert not fnmatch.fnmatch(path, glob)
    assert gpt.module_pattern(LayerKey(3, "linear_fc2"), 2) == "decoder.layers.0.mlp.linear_fc2"
