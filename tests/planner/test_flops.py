import pytest

from snip_megatron.plan import LINEAR_NAMES, LayerKey
from snip_megatron.planner.flops import flop_table, stage_of_layers, stages_for_keys
from snip_megatron.shapes import get_shape


def test_flop_table_is_six_nmk_per_linear():
    shape = get_shape("llama_70b")
    table = flop_table(shape)
    assert len(table) == 80 * 4
    n = shape.seq_length
    assert table[LayerKey(1, "linear_qkv")] == 6 * n * 10240 * 8192  # 64 q heads + 2*8 kv heads of 128
    assert table[LayerKey(80, "linear_fc1")] == 6 * n * 2 * 28672 * 8192
    assert table[LayerKey(3, "linear_fc2")] == 6 * n * 8192 * 28672
    assert flop_table(shape, tokens=2 * n)[LayerKey(1, "linear_proj")] == 2 * table[LayerKey(1, "linear_proj")]


@pytest.mark.parametrize("tokens", [0, -1, 1.5, True])
def test_flop_table_rejects_bad_tokens(tokens):
    with pytest.raises(ValueError, match="tokens"):
        flop_table(get_shape("llama_tiny"), tokens=tokens)


def test_stage_of_layers_even_split_and_vpp():
    assert stage_of_layers(8, 2) == {1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1, 7: 1, 8: 1}
    # VPP=2, PP=2: chunks of 2 layers round-robin over the stages (Megatron's interleaving).
    assert stage_of_layers(8, 2, vpp=2) == {1: 0, 2: 0, 3: 1, 4: 1, 5: 0, 6: 0, 7: 1, 8: 1}
    s = stage_of_layers(80, 8)
    assert [sum(1 for v in s.values() if v == st) for st in range(8)] == [10] * 8
    with pytest.raises(ValueError, match="not divisible"):
        stage_of_layers(10, 4)
    with pytest.raises(ValueError, match="pp"):
        stage_of_layers(8, 0)


def test_stages_for_keys():
    keys = [LayerKey(layer, name) for layer in (1, 4) for name in LINEAR_NAMES]
    st = stages_for_keys(keys, stage_of_layers(4, 2))
    assert st[LayerKey(1, "linear_fc2")] == 0 and st[LayerKey(4, "linear_qkv")] == 1
    with pytest.raises(ValueError, match="no pipeline stage"):
        stages_for_keys([LayerKey(5, "linear_qkv")], stage_of_layers(4, 2))
