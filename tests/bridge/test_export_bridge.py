"""The Bridge export read by Bridge itself: `process_config_with_overrides(cfg, FILE)` (what
`--config-file` does) instantiates model.quant_recipe, and a model built from it runs the plan; the
export of every model shape (expert units, MLA and MTP, a HybridModel's layers) reaches its modules."""

import pytest

from snip_megatron.plan import LINEAR_NAMES, Plan, all_keys
from tests.bridge import tiny

CYCLE = ["fp4", "fp8", "bf16"]


def test_bridges_overrides_load_the_exported_quant_recipe(bridge_on_cpu, tmp_path):
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.core.quantization.quant_config import RecipeConfig
    from megatron.core.quantization.utils import get_quant_config_or_none

    from snip_megatron.export import export
    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.apply import current_plan
    from snip_megatron.megatron.layout import module_path
    from snip_megatron.megatron.model import build_gpt_model
    from snip_megatron.planner.flops import flop_table
    from snip_megatron.report import PlanLog
    from snip_megatron.shapes import ModelShape

    plan = Plan({k: CYCLE[(k.layer + LINEAR_NAMES.index(k.name)) % 3] for k in all_keys(2)})
    shape = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=256, seq_length=32)
    PlanLog(tmp_path, flop_table(shape), log=lambda msg: None).record(5, plan, None, {})
    path = export(tmp_path, "bridge", backend="emulated")

    cfg = process_config_with_overrides(tiny.tiny_config(), config_filepath=str(path))
    recipe = cfg.model.quant_recipe
    assert isinstance(recipe, RecipeConfig)
    for key in all_keys(2):
        qc = get_quant_config_or_none(module_path(key.layer - 1, key.name), recipe)
        assert qc.config["precision"] == plan[key].value
    runtime.initialize_model_parallel(tp=1, pp=1)
    model = build_gpt_model(shape, backend="emulated", quant_recipe=recipe)
    assert current_plan(model) == plan


@pytest.mark.parametrize("name", ["moe_local", "mla_mtp", "hybrid_moe_mamba_gdn"])
def test_bridges_overrides_load_every_shapes_export(tmp_path, name):
    """Expert units (every local expert), MLA's and MTP's linears, a HybridModel's layers by its
    pattern: Bridge's own override processing instantiates the export, and every module Megatron
    builds for a planned linear gets its plan's precision (tests/test_export_shapes.py's cases)."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.core.quantization.utils import get_quant_config_or_none

    from snip_megatron.export import export
    from tests.test_export import precision_of
    from tests.test_export_shapes import CASES, logged, striped

    case = CASES[name]
    plan = striped(case.inventory)
    path = export(logged(tmp_path, plan, case.inventory), "bridge", pattern=case.pattern)
    recipe = process_config_with_overrides(tiny.tiny_config(), config_filepath=str(path)).model.quant_recipe
    for module, key in case.paths.items():
        assert precision_of(get_quant_config_or_none(module, recipe).config) is plan[key], module
    for module in case.unplanned:
        assert get_quant_config_or_none(module, recipe) is None, module
