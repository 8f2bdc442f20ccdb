"""Inventory: lookup, FLOPs, agreement, and the merge of the ranks' parts (pure)."""

from __future__ import annotations

import pytest

from snip_megatron.models import gpt
from snip_megatron.models.inventory import Inventory, InventoryEntry, ParallelKind, merge
from snip_megatron.models.keys import LayerKey, parse_key
from snip_megatron.shapes import get_shape


def test_keys_parse_any_dotted_name_and_refuse_bad_forms():
    assert parse_key("12.linear_fc1") == LayerKey(12, "linear_fc1")
    assert parse_key("3.shared_experts.linear_fc1") == LayerKey(3, "shared_experts.linear_fc1")
    for bad, words in [("7", "expected '<layer>.<linear name>'"), ("0.a", "start at 1"),
                       ("x.a", r"expected \(layer number"), ("1.9x", "dotted identifiers")]:
        with pytest.raises(ValueError, match=words):
            parse_key(bad)


def test_lookup_flops_and_layers():
    inv = gpt.inventory(get_shape("llama_tiny"))
    e = inv.entry("2.linear_fc1")
    assert e.suffix == "mlp.linear_fc1" and e.kind is ParallelKind.COLUMN and e.layer == 2
    assert e.shape == (704, 128) and e.flops_per_token == 6 * 704 * 128
    assert inv.flop_table(10)[LayerKey(2, "linear_fc1")] == 10 * 6 * 704 * 128
    assert inv.layers() == tuple(range(1, 7)) and inv.num_layers == 6 and len(inv) == 24
    assert inv.names_by_layer()[1] == gpt.LINEAR_NAMES
    assert "1.linear_qkv" in inv and "7.linear_qkv" not in inv and "bad" not in inv
    with pytest.raises(ValueError, match="no planned linear 7.linear_qkv; its layers have linear_fc1"):
        inv.entry("7.linear_qkv")
    assert any(u.path == "output_layer" for u in inv.unplanned)


def test_sequence_parallel_shards_the_input_of_column_linears_only():
    inv = gpt.inventory(get_shape("llama_tiny"), sequence_parallel=True)
    assert [e.sp_shards_input for e in inv][:4] == [True, False, True, False]
    assert not any(e.sp_shards_input for e in gpt.inventory(get_shape("llama_tiny")))


def test_merge_joins_stages_in_layer_order_and_refuses_disagreement():
    whole = gpt.inventory(get_shape("llama_tiny"))
    first = Inventory("gpt", [e for e in whole if e.layer <= 3])
    second = Inventory("gpt", [e for e in whole if e.layer > 3])
    assert merge([second, first, first, second]) == whole  # PP stages x TP peers, any rank order
    other = Inventory("gpt", [InventoryEntry(e.key, e.suffix, (e.shape[0] + 1, e.shape[1]), e.kind)
                              if e.key == LayerKey(4, "linear_fc2") else e for e in second])
    with pytest.raises(ValueError, match="ranks disagree on layer 4's planned linears: rank 1 has .*, rank 2 has"):
        merge([first, second, other])
    with pytest.raises(ValueError, match="1 linear.s. missing .6.linear_fc2."):
        whole.check_same(Inventory("gpt", whole[:-1]))
    with pytest.raises(ValueError, match="lists 1.linear_qkv twice"):
        Inventory("gpt", [whole[0], whole[0]])
