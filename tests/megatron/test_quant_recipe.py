"""Plan -> RecipeConfig: the matcher keys on the global layer number; Megatron's own lookup and
GPTModel's finish_init loop deliver each planned linear exactly its precision."""

from __future__ import annotations

import pytest
from megatron.core.quantization.quant_config import GlobMatcher, MatchContext, RecipeConfig
from megatron.core.quantization.utils import get_quant_config_or_none

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.megatron.quant_recipe import (PlanMatcher, build_recipe, config_dict_for,
                                                 key_for_path, layer_offset, parse_planned_path,
                                                 recipe_for_chunk)
from snip_megatron.plan import LINEAR_NAMES, LayerKey, Plan, all_keys
from snip_megatron.te import te_params

CYCLE = [Precision.BF16, Precision.FP8, Precision.FP4]


def striped(num_layers: int) -> Plan:
    return Plan({k: CYCLE[(k.layer + i) % 3] for k in all_keys(num_layers)
                 for i in [LINEAR_NAMES.index(k.name)]})


@pytest.mark.parametrize("path, parsed", [
    ("decoder.layers.3.mlp.linear_fc1", (3, "linear_fc1")),
    ("decoder.layers.0.self_attention.linear_qkv", (0, "linear_qkv")),
    ("module.decoder.layers.12.self_attention.linear_proj", (12, "linear_proj")),
    ("decoder.layers.3.mlp", None),
    ("output_layer", None),
    ("mtp.layers.0.transformer_layer.mlp.linear_fc1", None),  # MTP: not planned
    ("decoder.layers.1.mlp.experts.linear_fc1", (1, "expert_fc1")),  # MoE experts: one unit per layer,
    ("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2", (1, "expert_fc2")),  # whichever path
    ("decoder.layers.1.mlp.router", None),
    ("decoder.layers.1.mlp.linear_fc1.weight", None),
])
def test_planned_paths(path, parsed):
    assert parse_planned_path(path) == parsed


def test_matcher_translates_stage_local_paths_to_global_keys():
    plan = striped(8)
    recipe = build_recipe(plan, layer_offset=4)  # e.g. the second of two pipeline stages
    for local in range(4):
        for name in LINEAR_NAMES:
            path = f"decoder.layers.{local}.{'mlp' if 'fc' in name else 'self_attention'}.{name}"
            qc = get_quant_config_or_none(path, recipe)
            # Megatron's MatchContext.layer_number is the stage-local 0-based index, not global.
            assert qc.match_input.layer_number == local
            assert qc.config["precision"] == plan[LayerKey(5 + local, name)].value
            assert key_for_path(path, 4) == LayerKey(5 + local, name)
    assert get_quant_config_or_none("output_layer", recipe) is None
    assert get_quant_config_or_none("embedding.word_embeddings", recipe) is None


def test_matcher_refuses_a_linear_the_plan_lacks_and_bad_arguments():
    matcher = PlanMatcher(Plan.uniform(2, "fp8"), layer_offset=2)
    with pytest.raises(ValueError, match=r"no precision for 3.linear_qkv .*covers layers 1..2"):
        matcher.match(MatchContext("decoder.layers.0.self_attention.linear_qkv", 0))
    with pytest.raises(ValueError, match="layer_offset must be a non-negative integer"):
        PlanMatcher(Plan.uniform(2, "fp8"), layer_offset=-1)
    with pytest.raises(ValueError, match="needs a Plan"):
        PlanMatcher({"1.linear_qkv": "fp8"})
    with pytest.raises(ValueError, match=r"missing 4 linear\(s\)"):
        build_recipe(Plan.uniform(2, "fp8"), num_layers=3)
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        build_recipe(Plan.uniform(2, "fp8"), backend="tpu")


def test_matcher_round_trips_through_its_config_dict():
    """Megatron-Bridge writes quant_recipe into run_config.yaml through `to_cfg_dict` (and
    instantiates `_target_` back): the plain form rebuilds an equal matcher."""
    import importlib
    import json

    matcher = PlanMatcher(striped(4), layer_offset=2)
    cfg = json.loads(json.dumps(matcher.to_cfg_dict()))  # plain JSON/YAML values only
    module, cls, method = cfg.pop("_target_").rsplit(".", 2)
    rebuilt = getattr(getattr(importlib.import_module(module), cls), method)(**cfg)
    assert rebuilt.plan == matcher.plan and rebuilt.layer_offset == 2


def test_plan_matcher_composes_with_other_matchers_first_match_wins():
    plan = Plan.uniform(2, "fp4")
    base = build_recipe(plan)
    recipe = RecipeConfig([base.matchers[0], GlobMatcher("*", "bf16")], base.configs)
    assert get_quant_config_or_none("decoder.layers.1.mlp.linear_fc2", recipe).config_key == "fp4"
    assert get_quant_config_or_none("output_layer", recipe).config_key == "bf16"


def test_emulated_and_te_config_dicts():
    emu = config_dict_for("emulated", formats=Formats(fp8_recipe="tensorwise", fp4_recipe="mxfp4"))
    assert emu == {"bf16": {"precision": "bf16"},
                   "fp8": {"precision": "fp8", "fp8_recipe": "tensorwise"},
                   "fp4": {"precision": "fp4", "fp4_recipe": "mxfp4"}}
    variants = Formats(fp8_format="hybrid", fp8_block_scales="pow2", fp4_gradient_rounding="nearest")
    assert config_dict_for("emulated", formats=variants)["fp8"] == {
        "precision": "fp8", "fp8_recipe": "blockwise", "fp8_format": "hybrid", "fp8_block_scales": "pow2"}
    assert config_dict_for("emulated", formats=variants)["fp4"] == {
        "precision": "fp4", "fp4_recipe": "nvfp4", "fp4_gradient_rounding": "nearest"}
    te = config_dict_for("te", sm=100)
    assert te == {p.value: te_params(p, formats=Formats(), sm=100) for p in Precision}
    plan = Plan.uniform(2, "fp8").replace({"1.linear_fc1": "fp4"})
    recipe = build_recipe(plan, backend="te", sm=100)
    qc = get_quant_config_or_none("decoder.layers.0.mlp.linear_fc1", recipe)
    assert qc.config["training_recipe"]["fp4_quantization_recipe"] == "nvfp4"
    # On Hopper TE has no FP4 dict (SNIP plans BF16/FP8 there): a plan with FP4 is refused.
    with pytest.raises(ValueError, match="fp4, which the te backend cannot run here: FP4 nvfp4: TE's NVFP4 kernels"):
        build_recipe(plan, backend="te", sm=90)
    hopper = build_recipe(Plan.uniform(2, "fp8").replace({"1.linear_fc1": "bf16"}), backend="te", sm=90)
    assert set(hopper.configs) == {"bf16", "fp8"}
    assert hopper.configs["fp8"]["training_recipe"]["fp8_quantization_recipe"] == "blockwise"
    # MXFP8 on Hopper has no TE kernel: the entry is absent and a plan using it is refused.
    mx = Formats(fp8_recipe="mxfp8")
    assert set(config_dict_for("te", sm=90, formats=mx)) == {"bf16"}
    with pytest.raises(ValueError, match="fp8, which the te backend cannot run here: FP8 mxfp8: TE's MXFP8 needs SM100"):
        build_recipe(plan, backend="te", sm=90, formats=mx)
    build_recipe(Plan.uniform(2, "bf16"), backend="te", sm=90, formats=mx)  # no FP8 linear: fine


@pytest.mark.parametrize("pp, vpp, expected", [
    (1, None, {(0, None): 0}),
    (2, None, {(0, None): 0, (1, None): 4}),
    (2, 2, {(0, 0): 0, (0, 1): 4, (1, 0): 2, (1, 1): 6}),
    (4, 2, {(0, 0): 0, (1, 0): 1, (3, 0): 3, (0, 1): 4, (3, 1): 7}),
])
def test_layer_offset_uses_megatron_split_without_a_process_group(pp, vpp, expected):
    from megatron.core.transformer.transformer_config import TransformerConfig
    import torch

    config = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp,
                               pipeline_dtype=torch.float32)
    for (pp_rank, vp_stage), offset in expected.items():
        assert layer_offset(config, pp_rank=pp_rank, vp_stage=vp_stage) == offset
    recipe = recipe_for_chunk(Plan.uniform(8, "fp8").replace({"8.linear_fc2": "bf16"}), config,
                              pp_rank=pp - 1, vp_stage=None if vpp is None else vpp - 1)
    assert get_quant_config_or_none(
        f"decoder.layers.{8 // (pp * (vpp or 1)) - 1}.mlp.linear_fc2", recipe).config_key == "bf16"
    with pytest.raises(ValueError, match=r"missing"):
        recipe_for_chunk(Plan.uniform(7, "fp8"), config, pp_rank=0, vp_stage=0 if vpp else None)


def test_gpt_model_finish_init_delivers_the_plan(megatron_single):
    """The real seam: GPTModel.__init__ resolves each module's config through our RecipeConfig."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from snip_megatron.megatron.model import make_transformer_config
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape
    from snip_megatron.megatron.spec import get_local_layer_spec, replace_planned_linears

    class Recording:
        def finish_init(self, quant_config):
            self.got = None if quant_config is None else quant_config.config["precision"]

    class Col(Recording, ColumnParallelLinear):
        pass

    class Row(Recording, RowParallelLinear):
        pass

    plan = striped(shape.num_layers)
    config = make_transformer_config(shape, quant_recipe=build_recipe(plan, num_layers=shape.num_layers))
    model = GPTModel(config=config, transformer_layer_spec=replace_planned_linears(get_local_layer_spec(), Col, Row),
                     vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length,
                     position_embedding_type="rope")
    got = {}
    for layer in model.decoder.layers:
        for name in LINEAR_NAMES:
            sub = layer.mlp if "fc" in name else layer.self_attention
            got[LayerKey(layer.layer_number, name)] = getattr(sub, name).got
    assert got == {k: v.value for k, v in plan.items()}


def test_a_hybrid_chunks_paths_match_by_its_pattern():
    """A HybridModel chunk (layers 5..8 of 'M*-M|M*G-') matches its Mamba, attention, MLP and GDN
    linears by global layer; its matcher's config dict names the family, a GPT one's does not."""
    import json

    from megatron.core.quantization.utils import get_quant_config_or_none

    from snip_megatron.models import hybrid
    from snip_megatron.shapes import get_shape

    pattern = "M*-M|M*G-"
    inv = hybrid.inventory(get_shape("llama_tiny").with_(num_layers=8), pattern)
    plan = Plan({k: "fp4" if k.layer == 7 else "fp8" for k in inv.keys()}, inventory=inv)
    recipe = build_recipe(plan, layer_offset=4, family="hybrid")
    got = {path: get_quant_config_or_none(path, recipe).config["precision"]
           for path in (hybrid.module_path(e, 4) for e in inv if e.layer > 4)}
    assert got == {"decoder.layers.0.mixer.in_proj": "fp8", "decoder.layers.0.mixer.out_proj": "fp8",
                   "decoder.layers.1.self_attention.linear_qkv": "fp8",
                   "decoder.layers.1.self_attention.linear_proj": "fp8",
                   "decoder.layers.2.self_attention.in_proj": "fp4", "decoder.layers.2.self_attention.out_proj": "fp4",
                   "decoder.layers.3.mlp.linear_fc1": "fp8", "decoder.layers.3.mlp.linear_fc2": "fp8"}
    assert get_quant_config_or_none("decoder.layers.0.mixer.conv1d", recipe) is None
    cfg = json.loads(json.dumps(recipe.matchers[0].to_cfg_dict()))
    assert cfg["family"] == "hybrid" and "family" not in PlanMatcher(striped(4)).to_cfg_dict()
    assert PlanMatcher.from_cfg(cfg["plan"], cfg["layer_offset"], cfg["family"]).key_for(
        "decoder.layers.2.self_attention.in_proj") == LayerKey(7, "in_proj")
    with pytest.raises(ValueError, match="unknown model family 'mamba'; SNIP plans gpt, hybrid"):
        PlanMatcher(plan, family="mamba")
