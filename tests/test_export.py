"""Plan export: the file each format writes, read back by its consumer's own parser, gives every
planned linear the plan's precision (Megatron's load_quantization_recipe and GPTModel's finish_init
loop; the Bridge form instantiated from its _target_s; the JSON by Plan.load)."""

import importlib

import pytest
import yaml
from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe

from snip_megatron.export import export, main as export_main, path_precisions
from snip_megatron.formats.precision import Precision
from snip_megatron.megatron.layout import module_path
from snip_megatron.plan import LINEAR_NAMES, Plan, all_keys
from snip_megatron.report import PlanLog, main as report_main
from snip_megatron.te.translate import precision_of_te_params

CYCLE = [Precision.FP4, Precision.FP8, Precision.BF16]


def striped(num_layers: int) -> Plan:
    return Plan({k: CYCLE[(k.layer + LINEAR_NAMES.index(k.name)) % 3] for k in all_keys(num_layers)})


def run_dir(tmp_path, plans):
    """A run folder with snip_plans.jsonl as the controller writes it (PlanLog)."""
    from snip_megatron.planner.flops import flop_table
    from snip_megatron.shapes import ModelShape

    shape = ModelShape(num_layers=plans[0][1].num_layers, hidden_size=64, ffn_hidden_size=128,
                       num_attention_heads=4, num_query_groups=2, seq_length=32)
    log = PlanLog(tmp_path, flop_table(shape), log=lambda msg: None)
    previous = None
    for step, plan in plans:
        log.record(step, plan, previous, {})
        previous = plan
    return tmp_path


def precision_of(config: dict) -> Precision:
    return Precision.parse(config["precision"]) if "precision" in config else precision_of_te_params(config)


def test_megatron_format_gives_every_linear_its_precision_through_megatrons_parser(tmp_path, capsys):
    final = striped(4)
    run = run_dir(tmp_path, [(0, Plan.uniform(4, "fp8")), (7, final)])
    report_main(["export", str(run), "--format", "megatron"])  # report.py's command line
    path = tmp_path / "snip_precision_config.yaml"
    assert f"megatron: {path}" in capsys.readouterr().out
    assert path.read_text().startswith(f"# SNIP plan of {run} applied at step 7")
    recipe = load_quantization_recipe(str(path))
    for key in all_keys(4):
        qc = get_quant_config_or_none(module_path(key.layer - 1, key.name), recipe)
        assert precision_of(qc.config) is final[key], key
        assert qc.config["training_recipe"]["override_nonquantized_autocast"]  # no global FP8 needed
    for other in ("output_layer", "embedding.word_embeddings", "decoder.layers.1.self_attention.core_attention",
                  "decoder.layers.11.mlp.linear_fc1", "decoder.final_layernorm"):
        assert get_quant_config_or_none(other, recipe) is None, other  # exact paths: nothing else matches


def test_step_picks_the_plan_in_force_and_json_is_a_pinnable_plan(tmp_path):
    first, second = Plan.uniform(2, "fp8"), striped(2)
    run = run_dir(tmp_path, [(0, first), (10, second)])
    out = export(run, "json", step=9, out=tmp_path / "at9.json")
    assert Plan.load(out) == first  # --snip-plan / snip.plan read it
    assert Plan.load(export(run, "json", step=10, out=tmp_path / "at10.json")) == second
    assert Plan.load(export(run, "json")) == second
    with pytest.raises(ValueError, match="first plan was applied at step 0"):
        export(run, "json", step=-1)
    with pytest.raises(ValueError, match="has no snip_plans.jsonl"):
        export(tmp_path / "elsewhere", "json")


def test_emulated_configs_build_a_model_that_runs_the_plan(tmp_path, megatron_single):
    from snip_megatron.megatron.apply import current_plan
    from snip_megatron.megatron.model import build_gpt_model
    from snip_megatron.shapes import ModelShape

    plan = striped(2)
    path = export(run_dir(tmp_path, [(3, plan)]), "megatron", backend="emulated")
    shape = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=256, seq_length=32)
    model = build_gpt_model(shape, backend="emulated", quant_recipe=load_quantization_recipe(str(path)))
    assert current_plan(model) == plan  # GPTModel's finish_init loop read the exported file


def instantiate(value):
    """An object of the _target_ convention Bridge's overrides instantiate."""
    if isinstance(value, dict) and "_target_" in value:
        module, _, name = value["_target_"].rpartition(".")
        kwargs = {k: instantiate(v) for k, v in value.items() if k != "_target_"}
        return getattr(importlib.import_module(module), name)(**kwargs)
    if isinstance(value, list):
        return [instantiate(v) for v in value]
    return value


def bridge_recipe(path):
    """The RecipeConfig a Bridge export's `model.quant_recipe` instantiates to."""
    return instantiate(yaml.safe_load(path.read_text())["model"]["quant_recipe"])


def test_bridge_format_instantiates_to_the_same_recipe(tmp_path):
    plan = striped(3)
    path = export(run_dir(tmp_path, [(5, plan)]), "bridge", sm=100, fp8_recipe="blockwise",
                  out=tmp_path / "recipe.yaml")
    recipe = bridge_recipe(path)
    for key in all_keys(3):
        qc = get_quant_config_or_none(module_path(key.layer - 1, key.name), recipe)
        assert precision_of(qc.config) is plan[key]
        if plan[key] is Precision.FP8:
            assert qc.config["training_recipe"]["fp8_quantization_recipe"] == "blockwise"


def test_te_configs_are_what_a_snip_run_on_that_gpu_gives_its_te_linears(tmp_path):
    run = run_dir(tmp_path, [(0, striped(2))])
    blackwell = load_quantization_recipe(str(export(run, "megatron", sm=100, out=tmp_path / "sm100.yaml")))
    fp4_key = next(k for k in all_keys(2) if striped(2)[k] is Precision.FP4)
    recipe = get_quant_config_or_none(module_path(fp4_key.layer - 1, fp4_key.name), blackwell).config["training_recipe"]
    assert recipe["fp4_quantization_recipe"] == "nvfp4" and recipe.get("custom_recipe_factory") is None
    # Before SM100 TE has no FP4 SNIP plans: a plan with FP4 layers exports for the emulated linears only.
    with pytest.raises(ValueError, match=r"(?s)NVFP4 kernels need SM100.*--backend emulated"):
        export(run, "megatron", sm=90)
    with pytest.raises(ValueError, match=r"(?s)--fp4-recipe='mxfp4'.*no Transformer Engine recipe.*--backend emulated"):
        export(run, "megatron", sm=100, fp4_recipe="mxfp4")
    with pytest.raises(ValueError, match=r"--fp8-recipe='mxfp8'.*SM100"):
        export(run, "megatron", sm=90, fp8_recipe="mxfp8")
    assert export(run, "megatron", sm=90, backend="emulated", fp4_recipe="mxfp4").is_file()


def test_pipelined_export_only_where_every_stage_local_path_has_one_precision(tmp_path):
    # PP=2 over 4 layers: stage 0 holds layers 1-2 at local 0-1, stage 1 layers 3-4 at local 0-1.
    symmetric = Plan({k: CYCLE[((k.layer - 1) % 2 + LINEAR_NAMES.index(k.name)) % 3] for k in all_keys(4)})
    paths = path_precisions(symmetric, pp=2)
    assert len(paths) == 8
    for key in all_keys(4):
        assert paths[module_path((key.layer - 1) % 2, key.name)] is symmetric[key]
    with pytest.raises(ValueError, match=r"PP=2: decoder.layers.0.self_attention.linear_qkv is layer 1 "
                                         r"fp8, layer 3 fp4 .*Export for PP=1"):
        path_precisions(striped(4), pp=2)
    # VPP=2 x PP=2: every chunk holds one layer, all at local index 0.
    uniform_layers = Plan({k: CYCLE[LINEAR_NAMES.index(k.name) % 3] for k in all_keys(4)})
    assert len(path_precisions(uniform_layers, pp=2, vpp=2)) == 4
    with pytest.raises(ValueError, match="VPP=2"):
        path_precisions(symmetric, pp=2, vpp=2)
    run = run_dir(tmp_path, [(0, symmetric)])
    recipe = load_quantization_recipe(str(export(run, "megatron", pp=2)))
    for key in all_keys(4):  # each stage's rank resolves its own stage-local paths
        qc = get_quant_config_or_none(module_path((key.layer - 1) % 2, key.name), recipe)
        assert precision_of(qc.config) is symmetric[key]


def test_command_line_errors_name_the_fix(tmp_path, capsys):
    run = run_dir(tmp_path, [(0, striped(4))])
    with pytest.raises(SystemExit) as e:
        export_main([str(run), "--format", "megatron", "--pp", "2"])
    assert e.value.code == 2 and "Export for PP=1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main([str(run), "--format", "onnx"])
