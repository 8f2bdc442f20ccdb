import math

import numpy as np
import pytest

from snip_megatron.plan import LayerKey, all_keys
from snip_megatron.stats.table import GLOBAL_FIELDS, StatsTable, field_names


def test_layout_round_trip_and_forward_order():
    keys = list(reversed(all_keys(2)))
    t = StatsTable(keys=keys, globals_={"loss": 3.5, "dp_size": 2})
    assert t.keys[0] == LayerKey(1, "linear_qkv")
    t.set((2, "linear_fc1"), "x_sq", 7.0)
    t.add((2, "linear_fc1"), "x_sq", 1.0)
    t.set((1, "linear_proj"), "ex.fp4", math.nan)
    a = t.to_array()
    assert a.shape == (9, len(field_names()))
    u = StatsTable.from_array(t.keys, a)
    assert u.get((2, "linear_fc1"), "x_sq") == 8.0
    assert u.globals_["loss"] == 3.5 and u.globals_["dp_size"] == 2
    assert u.nonfinite() == {LayerKey(1, "linear_proj"): ["ex.fp4"]}


def test_bad_inputs_rejected():
    t = StatsTable(keys=all_keys(1))
    with pytest.raises(ValueError, match="unknown statistics field"):
        t.get((1, "linear_qkv"), "nope")
    with pytest.raises(ValueError, match="not in this statistics table"):
        t.get((2, "linear_qkv"), "x_sq")
    with pytest.raises(ValueError, match="bf16"):
        StatsTable(keys=all_keys(1), precisions=("bf16",))
    with pytest.raises(ValueError, match="shape"):
        StatsTable(keys=all_keys(1), values=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="globals_"):
        StatsTable(keys=all_keys(1), globals_={"nope": 1})
    assert len(GLOBAL_FIELDS) <= len(field_names())
