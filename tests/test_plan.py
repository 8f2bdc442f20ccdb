"""Plan: keys, round trips, digests, diffs, FP4 fraction, and refusal of bad input."""

from __future__ import annotations

import json

import pytest

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import (LINEAR_NAMES, LayerKey, Plan, PlanChange, all_keys, parse_key)


def mixed_plan(num_layers: int = 3) -> Plan:
    cycle = [Precision.BF16, Precision.FP8, Precision.FP4]
    return Plan({k: cycle[i % 3] for i, k in enumerate(all_keys(num_layers))})


def test_keys_parse_from_every_form():
    assert parse_key("12.linear_fc1") == LayerKey(12, "linear_fc1")
    assert parse_key((3, "linear_qkv")) == parse_key(LayerKey(3, "linear_qkv")) == LayerKey(3, "linear_qkv")
    assert str(LayerKey(2, "linear_proj")) == "2.linear_proj"
    assert all_keys(2)[:4] == [LayerKey(1, n) for n in LINEAR_NAMES]


@pytest.mark.parametrize("bad, words", [
    ("7", "expected '<layer>.<linear name>'"),
    ("0.linear_qkv", "start at 1"),
    ("x.linear_qkv", "expected (layer number"),
    ("1.linear fc3", "must be dotted identifiers"),
])
def test_bad_keys_are_refused_by_name(bad, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        parse_key(bad)


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="unknown precision 'fp6'"):
        Plan({"1.linear_qkv": "fp6"})


def test_plan_is_sorted_in_forward_order_and_immutable():
    plan = Plan({"2.linear_qkv": "fp8", "1.linear_fc2": "fp4", "1.linear_qkv": "bf16"})
    assert list(plan) == [LayerKey(1, "linear_qkv"), LayerKey(1, "linear_fc2"), LayerKey(2, "linear_qkv")]
    assert plan["1.linear_fc2"] is Precision.FP4 and plan[(2, "linear_qkv")] is Precision.FP8
    assert not hasattr(plan, "__setitem__")
    assert plan.num_layers == 2 and plan.counts() == {"bf16": 1, "fp8": 1, "fp4": 1}


def test_json_and_yaml_round_trip(tmp_path):
    plan = mixed_plan(4)
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_yaml(plan.to_yaml()) == plan
    assert Plan.load(plan.save(tmp_path / "p.json")) == plan
    assert Plan.load(plan.save(tmp_path / "p.yaml")) == plan
    data = json.loads(plan.to_json())
    assert data["version"] == 1 and data["num_layers"] == 4
    assert data["layers"]["1"] == {"linear_qkv": "bf16", "linear_proj": "fp8",
                                   "linear_fc1": "fp4", "linear_fc2": "bf16"}


def test_handwritten_yaml_with_int_layers_and_upper_case_loads():
    plan = Plan.from_yaml("version: 1\nlayers:\n  1: {linear_qkv: FP4, linear_proj: bf16}\n")
    assert plan == Plan({"1.linear_qkv": "fp4", "1.linear_proj": "bf16"})


@pytest.mark.parametrize("text, words", [
    ('{"version": 3, "layers": {}}', "unsupported plan version 3; this SNIP reads versions 1, 2"),
    ('{"version": 1, "layers": {"1": {"mixer.in_proj": "fp8"}}}', "a version 1 plan holds only linear_qkv"),
    ('{"version": 1}', "'layers' must be a mapping"),
    ('{"version": 1, "layers": {"1": "fp8"}}', "layer '1' must map"),
    ('{"version": 1, "num_layers": 3, "layers": {"1": {"linear_qkv": "fp8"}}}', "declares num_layers=3"),
    ('[1, 2]', "must be a mapping"),
    ('{"version": 1,', "not valid JSON"),
    ('{"version": 1, "layers": {"1": {"linear_qkv": "int8"}}}', "unknown precision 'int8'"),
])
def test_malformed_serialised_plans_are_refused(text, words):
    with pytest.raises(ValueError, match=words):
        Plan.from_json(text)


def test_yaml_never_builds_python_objects():
    with pytest.raises(ValueError, match="not valid YAML"):
        Plan.from_yaml("!!python/object/apply:os.system ['true']")


def test_digest_is_stable_and_content_addressed():
    a, b = mixed_plan(3), Plan(dict(reversed(list(mixed_plan(3).items()))))
    assert a.digest() == b.digest() and len(a.digest()) == 64
    # Fixed value: a digest must not change across Python versions, processes or refactors.
    assert Plan.uniform(2, "fp8").digest() == "bfa9a0b3529b6a5f9ab0a2e880f753fb92a6469d2d3fc92a444c8947cf81471f"
    assert a.digest() != a.replace({"1.linear_qkv": "fp4"}).digest()
    assert hash(a) == hash(b)


def test_diff_lists_changes_in_forward_order():
    old = Plan.uniform(2, "fp8")
    new = old.replace({"2.linear_fc1": "fp4", "1.linear_proj": "bf16"})
    assert old.diff(new) == [PlanChange(LayerKey(1, "linear_proj"), Precision.FP8, Precision.BF16),
                             PlanChange(LayerKey(2, "linear_fc1"), Precision.FP8, Precision.FP4)]
    assert old.diff(old) == []
    shorter = Plan({k: v for k, v in old.items() if k.layer == 1})
    assert [c.new for c in old.diff(shorter)] == [None] * 4
    assert str(old.diff(new)[0]) == "1.linear_proj: fp8 -> bf16"
    with pytest.raises(ValueError, match="diff against a Plan"):
        old.diff({})


def test_fp4_fraction_weights_by_flops():
    plan = Plan({"1.linear_qkv": "fp4", "1.linear_proj": "fp8", "1.linear_fc1": "fp4", "1.linear_fc2": "bf16"})
    flops = {LayerKey(1, "linear_qkv"): 1.0, LayerKey(1, "linear_proj"): 1.0,
             LayerKey(1, "linear_fc1"): 6.0, LayerKey(1, "linear_fc2"): 2.0}
    assert plan.fp4_fraction(flops) == pytest.approx(0.7)
    assert plan.fraction_in("fp8", flops) == pytest.approx(0.1)
    # Extra entries (layers another rank owns) are ignored; string keys are accepted.
    assert plan.fp4_fraction({**{str(k): v for k, v in flops.items()}, "9.linear_qkv": 1e9}) == pytest.approx(0.7)
    assert Plan.uniform(3, "fp4").fp4_fraction({k: 1.0 for k in all_keys(3)}) == 1.0


@pytest.mark.parametrize("flops, words", [
    ({LayerKey(1, "linear_qkv"): 1.0}, "lacks 3 planned linear"),
    ({k: -1.0 for k in all_keys(1)}, "negative or NaN"),
    ({k: float("nan") for k in all_keys(1)}, "negative or NaN"),
    ({k: 0.0 for k in all_keys(1)}, "sums to zero"),
])
def test_fp4_fraction_refuses_bad_flop_tables(flops, words):
    with pytest.raises(ValueError, match=words):
        Plan.uniform(1, "fp4").fp4_fraction(flops)


def test_check_model_names_missing_and_extra_keys():
    plan = Plan.uniform(4, "fp8")
    assert plan.check_model(4) is plan
    with pytest.raises(ValueError, match=r"missing 8 linear\(s\) of the model, in layer\(s\) 5, 6"):
        plan.check_model(6)
    with pytest.raises(ValueError, match=r"key\(s\) the model lacks .*4\.linear_qkv"):
        plan.check_model(3)
    holey = Plan({k: "fp8" for k in all_keys(4) if k != LayerKey(2, "linear_fc2")})
    with pytest.raises(ValueError, match=r"missing 1 linear\(s\) of the model, in layer\(s\) 2: 2.linear_fc2"):
        holey.check_model(4)
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        plan.check_model(0)


def test_ids_round_trip_for_broadcast():
    plan = mixed_plan(5)
    ids = plan.to_ids(5)
    assert len(ids) == 20 and set(ids) == {0, 1, 2}
    assert Plan.from_ids(ids, 5) == plan
    with pytest.raises(ValueError, match=r"unknown precision id\(s\) \[7\]"):
        Plan.from_ids([7] * 20, 5)
    with pytest.raises(ValueError, match="expected 20 precision ids"):
        Plan.from_ids([0] * 19, 5)


def test_fp4_fraction_with_the_planners_flop_table():
    from snip_megatron.planner.flops import flop_table
    from snip_megatron.shapes import get_shape

    shape = get_shape("llama_70b")
    mlp_fp4 = Plan({k: "fp4" if k.name in ("linear_fc1", "linear_fc2") else "fp8"
                    for k in all_keys(shape.num_layers)})
    # Per layer: qkv 10240x8192, proj 8192x8192, fc1 57344x8192, fc2 8192x28672 -> MLP = 14/17.
    assert mlp_fp4.fp4_fraction(flop_table(shape)) == pytest.approx(14 / 17)
    assert mlp_fp4.fp4_fraction(flop_table(shape, tokens=7)) == pytest.approx(14 / 17)


def test_keys_of_any_inventory_and_refusal_of_names_the_model_lacks():
    from snip_megatron.models import gpt
    from snip_megatron.shapes import get_shape

    inv = gpt.inventory(get_shape("llama_tiny"))
    assert Plan.uniform(inv, "fp8") == Plan.uniform(6, "fp8")
    assert Plan.uniform(inv, "fp8").to_ids(inv) == Plan.uniform(6, "fp8").to_ids(6)
    with pytest.raises(ValueError, match="no planned linear 1.linear_fc3; its layers have linear_fc1, linear_fc2"):
        Plan({"1.linear_fc3": "fp8"}, inventory=inv)
    with pytest.raises(ValueError, match=r"key\(s\) the model lacks \(model: gpt: 24 linears over 6 layers\): "
                                         r"1.linear_fc3"):
        Plan.uniform(inv, "fp8").replace({"1.linear_fc3": "fp8"}).check_model(inv)


def test_other_names_are_written_as_version_2_and_read_back_in_forward_order(tmp_path):
    plan = Plan({"2.out_proj": "fp4", "2.in_proj": "fp8", "1.linear_qkv": "bf16"})
    assert list(plan) == [LayerKey(1, "linear_qkv"), LayerKey(2, "in_proj"), LayerKey(2, "out_proj")]
    data = json.loads(plan.to_json())
    assert data["version"] == 2 and list(data["layers"]["2"]) == [k.name for k in plan if k.layer == 2]
    assert Plan.load(plan.save(tmp_path / "p.yaml")) == plan and Plan.from_json(plan.to_json()) == plan
    assert json.loads(Plan.uniform(2, "fp8").to_json())["version"] == 1  # a GPT plan stays readable by v1 readers


def test_plans_and_state_written_before_the_inventory_still_load_and_resume():
    """tests/fixtures/v1: files written by the release before the inventory (plan format v1)."""
    from pathlib import Path

    from snip_megatron.pretrain.state import read_state_file

    here = Path(__file__).parent / "fixtures" / "v1"
    plan = Plan.load_for(here / "plan.json", 4)
    assert Plan.load(here / "plan.yaml") == plan and plan.counts() == {"bf16": 0, "fp8": 10, "fp4": 6}
    state = read_state_file(here / "snip_state.json")
    assert Plan.from_dict(state["plan"]) == plan
    assert Plan.from_dict(state["controller"]["pending"]["plan"]).counts()["fp4"] > 0
