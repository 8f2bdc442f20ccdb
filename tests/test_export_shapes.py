"""The static recipes of every model shape SNIP plans, from plans keyed by each shape's inventory
(built without training: models.gpt.inventory, models.hybrid.inventory): `report export`'s YAML,
read by Megatron's own parser, and its Bridge form, instantiated, give every module Megatron builds
for a planned linear its plan's precision (the module paths written out here as Megatron names
them: a SequentialMLP's every local expert, TE's grouped expert linear, MLA's down-projections, an
MTP layer's, a HybridModel's attention, MLP, MoE, Mamba and GDN layers) and nothing else theirs.
The GPT shapes built on the CPU from the exported file run its plan (GPTModel's finish_init loop
read it); a HybridModel's and TE's grouped experts are built over the TE double by
tests/analyze/test_models.py, which checks its exports against that model's modules. A hybrid
plan is exported by its pattern (the layer kinds and '|' segments), and refused without one.

Every export cell of the support matrix (model shape x backend x layout: PP=1, PP=2, PP=2 x VPP=2)
exports a plan with one precision per stage-local path, and each chunk's modules (their layer index
in the chunk, MTP on the last) get the plan's precision from the backend's configs; an FP4 plan
is refused on Hopper, and a HybridModel's for the emulated linears, which build none."""

import dataclasses
import fnmatch
import re
from typing import NamedTuple

import pytest
from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe

from snip_megatron.export import export, path_precisions
from snip_megatron.formats.precision import Precision
from snip_megatron.megatron.smoke import SMOKE_SHAPE
from snip_megatron.models import gpt, hybrid
from snip_megatron.models.inventory import Inventory
from snip_megatron.plan import Plan
from snip_megatron.report import PlanLog
from tests.test_export import bridge_recipe, precision_of

SHAPE = SMOKE_SHAPE.with_(num_layers=2)
MLA = gpt.MLADims(q_lora_rank=32, kv_lora_rank=48, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16)
MOE = gpt.MoEDims(num_experts=4, topk=2, ffn_hidden_size=32, shared_ffn_hidden_size=32, layer_freq=(1, 0))
CYCLE = [Precision.FP4, Precision.FP8, Precision.BF16]


class Case(NamedTuple):
    inventory: Inventory
    pattern: "str | None"
    """A HybridModel's --hybrid-layer-pattern."""
    paths: dict
    """{module path Megatron builds for a planned linear: its key}."""
    unplanned: tuple
    """Module paths of the same model that no matcher may reach."""


def gpt_paths(inventory: Inventory, experts: "str | None" = None) -> dict:
    """The GPT's module paths by key; an expert unit's as `experts` builds them: "local" (a
    SequentialMLP's every local expert) or "grouped" (TE's one grouped linear)."""
    out = {}
    for e in inventory:
        path = gpt.module_path(e.key)
        if e.experts and experts == "local":
            parent, leaf = path.rsplit(".", 1)
            out.update({f"{parent}.local_experts.{i}.{leaf}": e.key for i in range(e.experts)})
        else:
            out[path] = e.key
    return out


def hybrid_case(pattern: str) -> Case:
    inv = hybrid.inventory(SHAPE.with_(num_layers=len(pattern.replace("|", ""))), pattern, moe=MOE)
    paths = {f"decoder.layers.{e.layer - 1}.{e.suffix}": e.key for e in inv}  # PP=1: every layer's own index
    return Case(inv, pattern, paths, ("decoder.layers.0.mixer.conv1d", "decoder.layers.2.mlp.router",
                                      "decoder.final_norm", "output_layer"))


GPT_UNPLANNED = ("embedding.word_embeddings", "output_layer", "decoder.layers.0.self_attention.core_attention",
                 "decoder.final_layernorm", "decoder.layers.0.mlp.router")


def cases() -> dict:
    dense, mla = gpt.inventory(SHAPE), gpt.inventory(SHAPE, mla=MLA)
    mtp, moe = gpt.inventory(SHAPE, mla=MLA, mtp_num_layers=1), gpt.inventory(SHAPE, moe=MOE)
    return {"dense": Case(dense, None, gpt_paths(dense), GPT_UNPLANNED),
            "mla": Case(mla, None, gpt_paths(mla), GPT_UNPLANNED),
            "mla_mtp": Case(mtp, None, gpt_paths(mtp), GPT_UNPLANNED + ("mtp.layers.0.enorm",)),
            "moe_local": Case(moe, None, gpt_paths(moe, "local"), GPT_UNPLANNED),
            "moe_te_grouped": Case(moe, None, gpt_paths(moe, "grouped"), GPT_UNPLANNED),
            "hybrid": hybrid_case("*-*-"),
            "hybrid_moe_mamba_gdn": hybrid_case("M*E-G")}


CASES = cases()


def striped(inventory: Inventory) -> Plan:
    """Every precision over the model's linears, neighbours differing."""
    return Plan({k: CYCLE[i % 3] for i, k in enumerate(inventory.keys())}, inventory=inventory)


def logged(tmp_path, plan: Plan, inventory: Inventory):
    """A run folder whose snip_plans.jsonl holds `plan` (PlanLog, as the controller writes it)."""
    PlanLog(tmp_path, inventory.flop_table(32), log=lambda msg: None).record(3, plan, None, {})
    return tmp_path


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_shape_exports_every_planned_module_through_megatrons_parser(tmp_path, name):
    case = CASES[name]
    plan = striped(case.inventory)
    run = logged(tmp_path, plan, case.inventory)
    assert Plan.load(export(run, "json")).check_model(case.inventory) == plan
    megatron = load_quantization_recipe(str(export(run, "megatron", pattern=case.pattern)))
    bridge = bridge_recipe(export(run, "bridge", pattern=case.pattern))
    assert set(case.paths.values()) == set(case.inventory.keys())  # every planned linear has a module here
    for recipe in (megatron, bridge):
        for path, key in case.paths.items():
            qc = get_quant_config_or_none(path, recipe)
            assert qc is not None and precision_of(qc.config) is plan[key], (path, key)
        for path in case.unplanned:
            assert get_quant_config_or_none(path, recipe) is None, path


@pytest.mark.parametrize("name", ["dense", "mla_mtp", "moe_local"])
def test_a_gpt_built_from_the_exported_recipe_runs_its_plan(tmp_path, megatron_single, name):
    from snip_megatron.megatron.apply import list_planned_linears, megatron_core_version, precision_of as runs
    from snip_megatron.megatron.model import build_gpt_model

    if name == "mla_mtp" and megatron_core_version() < (0, 17):
        pytest.skip("megatron-core < 0.17 builds MLA only over Transformer Engine (model.check_mla_buildable), and "
                    "names an MTP layer's inner layer transformer_layer")
    case = CASES[name]
    plan = striped(case.inventory)
    path = export(logged(tmp_path, plan, case.inventory), "megatron", backend="emulated")
    fields = {"mla_mtp": dict(mla=MLA, mtp_num_layers=1), "moe_local": MOE.config_fields()}.get(name, {})
    model = build_gpt_model(SHAPE, backend="emulated", quant_recipe=load_quantization_recipe(str(path)), **fields)
    built = list_planned_linears(model)
    assert {pl.module_path: pl.key for pl in built} == case.paths  # the names this test expects
    assert all(runs(pl.module) is plan[pl.key] for pl in built)  # each local expert too


def test_a_hybrid_plan_is_exported_by_its_pattern_and_refused_without_one(tmp_path, capsys):
    from snip_megatron.report import main as report_main

    case = CASES["hybrid_moe_mamba_gdn"]
    run = logged(tmp_path, striped(case.inventory), case.inventory)
    report_main(["export", str(run), "--format", "megatron", "--hybrid-layer-pattern", case.pattern])
    path = run / "snip_precision_config.yaml"
    assert capsys.readouterr().out.strip() == f"megatron: {path}"
    assert path.read_text().startswith(f"# SNIP plan of {run} applied at step 3, digest ")
    assert f"module paths for HybridModel {case.pattern!r}, PP=1" in path.read_text().splitlines()[0]
    with pytest.raises(SystemExit) as e:  # the plan's Mamba and GDN in_proj: which module is which?
        report_main(["export", str(run), "--format", "megatron"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().endswith(
        "error: the plan's 1.in_proj is not a GPT linear: a HybridModel's plan needs --hybrid-layer-pattern (the run's)")
    with pytest.raises(ValueError, match=r"1\.in_proj: layer 1 of --hybrid-layer-pattern '\*\*E-G' is a '\*' layer \(attention\), which "
                                         r"has no in_proj"):
        export(run, "megatron", pattern="**E-G")
    # PP=2 of '*-*|-': stage 1 is the pattern's second segment, layer 4 alone (an even split of four
    # layers would give it layers 3 and 4)
    plan = striped(hybrid.inventory(SHAPE.with_(num_layers=4), "*-*|-"))
    paths = path_precisions(plan, pp=2, pattern="*-*|-")
    assert paths["decoder.layers.0.mlp.linear_fc1"] is plan["4.linear_fc1"]
    assert paths["decoder.layers.1.mlp.linear_fc1"] is plan["2.linear_fc1"]
    assert paths["decoder.layers.2.self_attention.linear_qkv"] is plan["3.linear_qkv"]
    assert len(paths) == len(plan)


# Every export cell of the support matrix: model shape x backend x pipeline layout, on 4-layer models.
CHUNKS = {"one": ((1, 2, 3, 4),), "pp": ((1, 2), (3, 4)), "vpp": ((1,), (2,), (3,), (4,))}
"""The global layers of each model chunk as Megatron builds them (GPT: get_transformer_layer_offset;
HybridModel: select_pipeline_segment over the pattern's '|' segments), chunk (pp_rank, vp_stage) at
index vp_stage * PP + pp_rank; MTP is built on the last."""
LAYOUT_FLAGS = {"one": {}, "pp": {"pp": 2}, "vpp": {"pp": 2, "vpp": 2}}
BACKENDS = {"emulated": {"backend": "emulated"}, "te_hopper": {"backend": "te", "sm": 90},
            "te_blackwell": {"backend": "te", "sm": 100}}
HOPPER = (Precision.BF16, Precision.FP8)
"""What Transformer Engine runs on SM90 (a plan with FP4 is refused there)."""
MOE4 = dataclasses.replace(MOE, layer_freq=(1, 0, 1, 0))
HYBRID_PATTERNS = {"hybrid": "*-*-", "hybrid_moe": "*E*E", "hybrid_ssm": "M*M*"}
"""The support matrix's HybridModel shapes."""


def matrix_models() -> dict:
    """The support matrix's model shapes, 4 layers each (their PP=1 module paths)."""
    shape = SHAPE.with_(num_layers=4)
    dense, mla, mtp = gpt.inventory(shape), gpt.inventory(shape, mla=MLA), gpt.inventory(shape, mtp_num_layers=1)
    moe = gpt.inventory(shape, moe=MOE4)
    mtp_unplanned = GPT_UNPLANNED + ("mtp.layers.0.enorm", "mtp.layers.0.hnorm", "mtp.layers.0.final_layernorm")
    return {"dense": Case(dense, None, gpt_paths(dense), GPT_UNPLANNED),
            "mla": Case(mla, None, gpt_paths(mla), GPT_UNPLANNED),
            "mtp": Case(mtp, None, gpt_paths(mtp), mtp_unplanned),
            "moe_local": Case(moe, None, gpt_paths(moe, "local"), GPT_UNPLANNED + ("decoder.layers.0.mlp.experts",)),
            "moe_te_grouped": Case(moe, None, gpt_paths(moe, "grouped"), GPT_UNPLANNED),
            **{name: hybrid_case(pattern) for name, pattern in HYBRID_PATTERNS.items()}}


MODELS = matrix_models()


def layout_pattern(pattern: "str | None", layout: str) -> "str | None":
    """A HybridModel's pattern cut into the layout's chunks by '|' (Megatron-LM reads PP x VPP from them)."""
    if pattern is None or layout == "one":
        return pattern
    return "|".join(pattern[chunk[0] - 1:chunk[-1]] for chunk in CHUNKS[layout])


def chunk_paths(case: Case, layout: str) -> list[dict]:
    """{module path Megatron builds on the chunk for a planned linear: key} of each chunk: a decoder
    layer's under its index in the chunk, an MTP layer's on the last chunk."""
    chunks = CHUNKS[layout]
    out = [{} for _ in chunks]
    for path, key in case.paths.items():
        if gpt.is_mtp(key):
            out[-1][path] = key
            continue
        i = next(i for i, chunk in enumerate(chunks) if key.layer in chunk)
        out[i][re.sub(r"^decoder\.layers\.\d+\.", f"decoder.layers.{chunks[i].index(key.layer)}.", path)] = key
    return out


def layout_plan(case: Case, layout: str, precisions) -> Plan:
    """Precision by (layer index in its chunk, linear name): one precision per stage-local path, as a
    pipelined export needs, and neighbours differing."""
    local = {layer: chunk.index(layer) for chunk in CHUNKS[layout] for layer in chunk}
    names = sorted({k.name for k in case.inventory.keys()})
    return Plan({k: precisions[(local[k.layer] + names.index(k.name)) % len(precisions)]
                 for k in case.inventory.keys()}, inventory=case.inventory)


EXPORT_CELLS = [(m, b, lay) for m in MODELS for b in BACKENDS for lay in CHUNKS
                if b != "emulated" or (m not in HYBRID_PATTERNS and m != "moe_te_grouped")]
"""Cells with an export to check: SNIP's emulated linears build no TE grouped experts and no HybridModel."""


@pytest.mark.parametrize("model,backend,layout", EXPORT_CELLS, ids=["-".join(cell) for cell in EXPORT_CELLS])
def test_every_cell_exports_each_stages_planned_modules_through_megatrons_parser(tmp_path, model, backend, layout):
    case = MODELS[model]
    hopper = backend == "te_hopper"
    plan = layout_plan(case, layout, HOPPER if hopper else CYCLE)
    flags = {**BACKENDS[backend], **LAYOUT_FLAGS[layout], "pattern": layout_pattern(case.pattern, layout)}
    run = logged(tmp_path / "run", plan, case.inventory)
    recipes = (load_quantization_recipe(str(export(run, "megatron", **flags))),
               bridge_recipe(export(run, "bridge", **flags)))
    stages = chunk_paths(case, layout)
    assert sorted(key for stage in stages for key in stage.values()) == sorted(case.paths.values())
    built = [path for stage in stages for path in stage]
    for recipe in recipes:
        for stage in stages:  # each rank resolves its own chunks' stage-local paths
            for path, key in stage.items():
                qc = get_quant_config_or_none(path, recipe)
                assert qc is not None and precision_of(qc.config) is plan[key], (path, key)
                assert ("precision" in qc.config) is (backend == "emulated"), qc.config  # the backend's configs
        for path in case.unplanned:
            assert get_quant_config_or_none(path, recipe) is None, path
        for matcher in recipe.matchers:  # none written for a module no stage builds (a wrong layer index)
            assert any(fnmatch.fnmatch(path, matcher.pattern) for path in built), matcher.pattern
    if hopper:  # the same layout's plan with FP4 layers: TE has no FP4 kernels before SM100
        fp4 = layout_plan(case, layout, CYCLE)
        fix = "a HybridModel's linears are TE's" if case.pattern else "or export with --backend emulated"
        with pytest.raises(ValueError, match=r"(?s)SM90 \(Hopper\).*TE's NVFP4 kernels need SM100\+.*\n\(" + fix):
            export(logged(tmp_path / "fp4", fp4, case.inventory), "megatron", **flags)


HYBRID_EMULATED = [(m, lay) for m in HYBRID_PATTERNS for lay in CHUNKS]


@pytest.mark.parametrize("model,layout", HYBRID_EMULATED, ids=[f"{m}-emulated-{lay}" for m, lay in HYBRID_EMULATED])
def test_a_hybrid_export_is_refused_for_emulated_linears_and_where_the_pattern_is_not_the_layouts(tmp_path, model,
                                                                                                 layout):
    case = MODELS[model]
    run = logged(tmp_path, layout_plan(case, layout, CYCLE), case.inventory)
    flags = {**LAYOUT_FLAGS[layout], "pattern": layout_pattern(case.pattern, layout)}
    with pytest.raises(ValueError, match=r"^SNIP plans a HybridModel's Transformer Engine linears .*SNIP's emulated "
                                         r"linears build no HybridModel.*; use --backend te$"):
        export(run, "bridge", backend="emulated", **flags)
    for other in ("pp", "vpp"):  # '|' segments other than the layout's chunks would drop or misplace layers
        if other != layout:
            chunks, segments = len(CHUNKS[layout]), len(CHUNKS[other])
            refusal = (rf"has {segments} '\|' segments, one per model chunk, but PP=\d.* has {chunks} chunks: "
                       rf"export with --pp and --vpp whose product is {segments}")
            with pytest.raises(ValueError, match=refusal):
                export(run, "megatron", **{**flags, "pattern": layout_pattern(case.pattern, other)})
    last = ", ".join(str(k) for k in case.inventory.keys() if k.layer == 4)
    with pytest.raises(ValueError, match=re.escape(f"holds the plan's {last} (the pattern is not the run's)")):
        export(run, "megatron", **{**flags, "pattern": flags["pattern"][:-1]})  # its last layer left out
