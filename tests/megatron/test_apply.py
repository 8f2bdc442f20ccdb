"""apply_plan / list_planned_linears.

In-process: the lookup by global layer and the TE path (a stand-in for TE linears that keeps
their `finish_init`/`te_quant_params` contract: TE itself cannot run on CPU).
Multi-process (this file is also the torchrun worker): a plan applied at build time and another
at step k, on TP=1, TP=2, PP=2, PP=2 x VPP=2 and DP=2 with SNIP's emulated linears.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
import torch

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import LINEAR_NAMES, LayerKey, Plan, all_keys

CYCLE = [Precision.BF16, Precision.FP8, Precision.FP4]


def plan_a(num_layers: int) -> Plan:
    """Build-time plan: every precision in every layer, shifted per layer."""
    return Plan({k: CYCLE[(k.layer + LINEAR_NAMES.index(k.name)) % 3] for k in all_keys(num_layers)})


def plan_b(num_layers: int) -> Plan:
    """Step-k plan: a few linears moved, in the first and the last layer (two PP stages)."""
    a = plan_a(num_layers)
    moves = [LayerKey(1, "linear_fc1"), LayerKey(1, "linear_qkv"),
             LayerKey(num_layers, "linear_proj"), LayerKey(num_layers, "linear_fc2")]
    return a.replace({k: CYCLE[(CYCLE.index(a[k]) + 1) % 3] for k in moves})


# ---------------------------------------------------------------- in-process, with stand-ins


class _TELike:
    """Megatron TE linear contract: finish_init parses TEQuantizationParams; will_execute_quantized."""

    def finish_init(self, quant_config):
        from megatron.core.extensions.transformer_engine import TEQuantizationParams

        self.te_quant_params = (None if quant_config is None
                                else TEQuantizationParams.parse_from_config(quant_config))
        self.finish_init_calls = getattr(self, "finish_init_calls", 0) + 1

    def will_execute_quantized(self, is_context_quantized):
        return is_context_quantized


def _build(layer_spec_classes, shape, plan=None, recipe_kwargs=None):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from snip_megatron.megatron.model import make_transformer_config
    from snip_megatron.megatron.quant_recipe import build_recipe
    from snip_megatron.megatron.spec import get_local_layer_spec, replace_planned_linears

    recipe = None if plan is None else build_recipe(plan, **(recipe_kwargs or {}))
    config = make_transformer_config(shape, quant_recipe=recipe)
    spec = replace_planned_linears(get_local_layer_spec(), *layer_spec_classes)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=shape.vocab_size,
                    max_sequence_length=shape.seq_length, position_embedding_type="rope")


def _te_like_classes():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return (type("TECol", (_TELike, ColumnParallelLinear), {}),
            type("TERow", (_TELike, RowParallelLinear), {}))


def test_te_linears_switch_through_finish_init(megatron_single):
    from snip_megatron.megatron.apply import apply_plan, current_plan, list_planned_linears
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape

    n = shape.num_layers
    a = Plan.uniform(n, "fp8").replace({"2.linear_fc2": "bf16"})
    model = _build(_te_like_classes(), shape, a, dict(backend="te", sm=100))
    assert current_plan(model) == a  # build time, through GPTModel's finish_init loop
    b = a.replace({"1.linear_qkv": "fp4", "2.linear_fc2": "fp8", "4.linear_proj": "bf16"})
    changes = apply_plan(model, b, sm=100)
    assert [(str(c.key), c.old, c.new) for c in changes] == [
        ("1.linear_qkv", Precision.FP8, Precision.FP4), ("2.linear_fc2", Precision.BF16, Precision.FP8),
        ("4.linear_proj", Precision.FP8, Precision.BF16)]
    assert current_plan(model) == b
    fc1 = {pl.key: pl.module for pl in list_planned_linears(model)}[LayerKey(1, "linear_qkv")]
    recipe = fc1.te_quant_params.training_recipe
    assert recipe.fp4_quantization_recipe == "nvfp4" and recipe.override_nonquantized_autocast
    assert apply_plan(model, b, sm=100) == []  # nothing to do: nothing re-initialised
    # Hopper: FP4 only exists in the emulated linear, so a TE model refuses it, untouched.
    with pytest.raises(ValueError, match="Transformer Engine linear, and fp4 runs only in the emulated"):
        apply_plan(model, b.replace({"3.linear_fc1": "fp4"}), sm=90)
    assert current_plan(model) == b


def test_lookup_refusals_and_untouched_model_on_bad_plans(megatron_single):
    from snip_megatron.megatron.apply import apply_plan, current_plan, list_planned_linears
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape

    n = shape.num_layers
    model = _build(_te_like_classes(), shape, Plan.uniform(n, "fp8"), dict(backend="te", sm=90))
    linears = list_planned_linears(model)
    assert [pl.key for pl in linears] == all_keys(n)
    assert linears[5].module_path == "decoder.layers.1.self_attention.linear_proj"
    key, module = linears[0]  # unpacks as (key, module)
    assert key == LayerKey(1, "linear_qkv") and module is model.decoder.layers[0].self_attention.linear_qkv
    holey = Plan({k: "bf16" for k in all_keys(n) if k != LayerKey(3, "linear_fc1")})
    with pytest.raises(ValueError, match=r"missing 1 linear\(s\) of the model, in layer\(s\) 3"):
        apply_plan(model, holey, sm=90)
    with pytest.raises(ValueError, match=r"key\(s\) the model lacks"):
        apply_plan(model, Plan.uniform(n + 1, "bf16"), sm=90)
    with pytest.raises(ValueError, match="needs a Plan"):
        apply_plan(model, {"1.linear_qkv": "bf16"}, sm=90)
    assert current_plan(model) == Plan.uniform(n, "fp8")


def test_plain_linears_are_refused(megatron_single):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from snip_megatron.megatron.apply import apply_plan
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape

    model = _build((ColumnParallelLinear, RowParallelLinear), shape)
    with pytest.raises(ValueError, match="ColumnParallelLinear, which cannot switch precision"):
        apply_plan(model, Plan.uniform(shape.num_layers, "fp8"))
