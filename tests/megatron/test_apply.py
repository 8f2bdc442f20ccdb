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

from snip_megatron.formats.precision import Formats, Precision
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
    # Hopper: no FP4 with TE; a plan with one more FP4 linear is refused whole, nothing changes.
    c = b.replace({"3.linear_fc1": "fp4"})
    with pytest.raises(ValueError, match=r"fp4, which the te backend cannot run here: FP4 nvfp4: TE's NVFP4 "
                                         r"kernels need SM100\+"):
        apply_plan(model, c, sm=90)
    assert current_plan(model) == b
    c = b.replace({"3.linear_fc1": "fp4"})
    apply_plan(model, c, sm=100)
    # MXFP4 has no TE recipe: the whole plan is refused before any module changes.
    with pytest.raises(ValueError, match="fp4, which the te backend cannot run here: FP4 mxfp4: fp4_recipe='mxfp4' has no"):
        apply_plan(model, c.replace({"4.linear_fc1": "fp4", "4.linear_qkv": "bf16"}), sm=100,
                   formats=Formats(fp4_recipe="mxfp4"))
    assert current_plan(model) == c



@pytest.mark.compat
def test_te_weight_caches_stay_fresh_where_megatron_does_not_rearm_them():
    """Megatron's schedule re-arms each TE linear's weight cache at a step's first micro-batch
    (MegatronModule.set_is_first_microbatch): for a quant_recipe from megatron-core 0.19, only under
    a global fp8/fp4 before. Asked of Megatron itself here, not of its version number: where it does
    not re-arm, SNIP turns each planned TE linear's cache off and says so at start-up."""
    from types import SimpleNamespace

    from megatron.core.transformer.module import MegatronModule

    from snip_megatron.megatron.apply import keep_te_weights_fresh, megatron_refreshes_te_weights, weight_cache_notice

    config = SimpleNamespace(fp8=None, fp4=None, quant_recipe=object())
    model = MegatronModule(config)
    model.linear = torch.nn.Linear(1, 1)
    model.linear.is_first_microbatch = False
    model.set_is_first_microbatch()
    rearms = model.linear.is_first_microbatch
    assert megatron_refreshes_te_weights(config) is rearms
    linear = SimpleNamespace(config=config)
    assert keep_te_weights_fresh(linear) is (not rearms)
    assert getattr(linear, "disable_parameter_transpose_cache", False) is (not rearms)
    notice = weight_cache_notice()
    assert (notice is None) is rearms, notice
    if not rearms:
        assert notice.startswith("megatron-core 0.") and "SNIP turns the cache off" in notice, notice
    assert megatron_refreshes_te_weights(SimpleNamespace(fp8="hybrid", fp4=None, quant_recipe=None))  # any release

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


def test_one_plan_entry_switches_every_expert_of_an_moe_unit(megatron_single):
    """An MoE layer's SequentialMLP experts (the local spec) are one unit: one precision in the plan
    sets them all, build time (quant_recipe) and step k (apply_plan) alike, and the change is one."""
    from snip_megatron.megatron.apply import apply_plan, current_plan, list_planned_linears
    from snip_megatron.megatron.model import build_model_chunks, make_transformer_config
    from snip_megatron.megatron.quant_recipe import build_recipe
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape
    from snip_megatron.models import gpt

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 0, 1])
    inv = gpt.of_config(make_transformer_config(shape, **moe))
    first = Plan({k: Precision.FP4 if k.name == "expert_fc1" else Precision.BF16 for k in inv.keys()})
    config = make_transformer_config(shape, quant_recipe=build_recipe(first, num_layers=inv), **moe)
    chunks = build_model_chunks(shape, config=config, backend="emulated")
    experts = {pl.module_path: pl.module.precision for pl in list_planned_linears(chunks) if pl.entry.experts}
    assert len(experts) == 2 * 2 * 4  # two MoE layers, fc1 and fc2, four experts
    assert all((p is Precision.FP4) == path.endswith("linear_fc1") for path, p in experts.items())
    second = first.replace({LayerKey(4, "expert_fc2"): Precision.FP8, LayerKey(2, "expert_fc1"): Precision.BF16})
    changes = apply_plan(chunks, second)
    assert sorted(str(c.key) for c in changes) == ["2.expert_fc1", "4.expert_fc2"]
    assert current_plan(chunks) == second
    layer4 = [pl.module for pl in list_planned_linears(chunks) if pl.key == LayerKey(4, "expert_fc2")]
    assert len(layer4) == 4 and all(m.precision is Precision.FP8 for m in layer4)


def test_plain_linears_are_refused(megatron_single):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from snip_megatron.megatron.apply import apply_plan
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape

    model = _build((ColumnParallelLinear, RowParallelLinear), shape)
    with pytest.raises(ValueError, match="ColumnParallelLinear, which cannot switch precision"):
        apply_plan(model, Plan.uniform(shape.num_layers, "fp8"))


# ---------------------------------------------------------------- multi-process (torchrun, gloo)

# layout -> (tp, pp, vpp). Two CPU cores: two ranks, so the 2-rank layouts without TP or PP are DP=2.
LAYOUTS = {"tp1": (1, 1, None), "tp2": (2, 1, None), "pp2": (1, 2, None), "pp2_vpp2": (1, 2, 2),
           "dp2": (1, 1, None)}
STEPS_BEFORE, STEPS_AFTER = 3, 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{layout: [per-rank result dicts]}. The single process runs here, in-process; one 2-process
    launch runs the 2-rank layouts one after another (Megatron's parallel state rebuilt in
    between), which keeps the start-up cost to one launch."""
    from snip_megatron.megatron import runtime
    from tests.distributed import run_distributed

    out = tmp_path_factory.mktemp("apply")
    run_distributed([__file__, "--layouts", "tp2,pp2,pp2_vpp2,dp2", "--out", str(out)], nproc=2,
                    timeout=300)
    results = {name: [json.loads(f.read_text()) for f in sorted((out / name).glob("rank*.json"))]
               for name in LAYOUTS if name != "tp1"}
    runtime.init_process_group()
    results["tp1"] = [run_layout(*LAYOUTS["tp1"])]
    return results


def _union(ranks: list[dict], field: str) -> dict:
    merged: dict = {}
    for r in ranks:
        for key, value in r[field].items():
            assert merged.setdefault(key, value) == value, f"ranks disagree on {key}"
    return merged


@pytest.mark.launches
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_build_time_and_step_k_plans_reach_every_module(runs, case):
    from snip_megatron.megatron.smoke import SMOKE_SHAPE

    n = SMOKE_SHAPE.num_layers
    a, b = plan_a(n), plan_b(n)
    ranks = runs[case]
    nproc = 1 if case == "tp1" else 2
    assert len(ranks) == nproc
    assert Plan(_union(ranks, "build")) == a
    assert Plan(_union(ranks, "after")) == b
    owners: dict = {}
    for r in ranks:
        for key in r["build"]:
            owners.setdefault(key, set()).add(r["rank"])
        # apply_plan reports exactly this rank's part of the diff
        local = set(r["build"])
        assert [tuple(c) for c in r["changes"]] == [
            (str(c.key), c.old.value, c.new.value) for c in a.diff(b) if str(c.key) in local]
        # outputs change exactly for the re-planned linears (same weights, same input)
        assert r["out_changed"] == {k: a[k] is not b[k] for k in local}
    # PP: each key on one stage (all its TP/DP ranks); otherwise on every rank
    pp = 2 if "pp2" in case else 1
    assert all(len(v) == nproc // pp for v in owners.values())


@pytest.mark.launches
def test_a_layer_whose_local_index_differs_from_its_global_one(runs):
    stage1 = [r for r in runs["pp2"] if r["pp_rank"] == 1][0]
    assert stage1["paths"]["3.linear_fc1"] == [0, "module.decoder.layers.0.mlp.linear_fc1"]
    vpp0 = [r for r in runs["pp2_vpp2"] if r["pp_rank"] == 0][0]
    # 4 layers, 2 stages x 2 chunks: stage 0 holds layers 1 and 3, each as its chunk's layer 0.
    assert vpp0["paths"]["3.linear_qkv"] == [1, "module.decoder.layers.0.self_attention.linear_qkv"]
    assert sorted({int(k.split(".")[0]) for k in vpp0["build"]}) == [1, 3]


@pytest.mark.launches
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_layout_enumeration_matches_the_built_model(runs, case):
    """The layout command derives stages, paths and shard shapes without building: compare each
    rank's enumeration with what Megatron actually built on that rank."""
    from snip_megatron.megatron.layout import layout_config, rank_layout
    from snip_megatron.megatron.smoke import SMOKE_SHAPE

    tp, pp, vpp = LAYOUTS[case]
    config = layout_config(SMOKE_SHAPE, tp=tp, pp=pp, vpp=vpp)
    for r in runs[case]:
        enumerated = rank_layout(SMOKE_SHAPE, config, tp_rank=r["tp_rank"], pp_rank=r["pp_rank"])
        assert {str(s.key): [s.chunk, "module." + s.module_path] for s in enumerated.linears} == r["paths"]
        assert {str(s.key): list(s.local_shape) for s in enumerated.linears} == r["weights"]


@pytest.mark.launches
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_every_rank_agrees_on_the_inventory_its_shape_gives(runs, case):
    """Each rank discovers its own layers; the all-gathered merge is the whole model on every rank."""
    from snip_megatron.megatron.smoke import SMOKE_SHAPE

    for r in runs[case]:
        assert r["local_inventory"] == [str(k) for k in all_keys(SMOKE_SHAPE.num_layers) if str(k) in r["build"]]
        assert r["inventory"] == [str(k) for k in all_keys(SMOKE_SHAPE.num_layers)]


@pytest.mark.launches
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_training_continues_across_the_replan_and_loss_falls(runs, case):
    losses = [r["losses"] for r in runs[case] if r["losses"]]
    assert losses, "no rank reported losses"
    for curve in losses:
        assert len(curve) == STEPS_BEFORE + STEPS_AFTER
        assert all(x == x and x < 1e4 for x in curve)
        assert curve[-1] < curve[STEPS_BEFORE] < curve[0]


@pytest.mark.launches
def test_every_layout_gives_the_single_process_precisions(runs):
    single = runs["tp1"][0]
    for case, ranks in runs.items():
        assert _union(ranks, "build") == single["build"], case
        assert _union(ranks, "after") == single["after"], case


def _linear_outputs(chunks) -> dict:
    """Each planned linear on a fixed input (same on every rank; TP ranks call in the same order)."""
    from snip_megatron.megatron.apply import list_planned_linears

    outs = {}
    with torch.no_grad():
        for pl in list_planned_linears(chunks):
            g = torch.Generator().manual_seed(1000 * pl.key.layer + LINEAR_NAMES.index(pl.key.name))
            x = torch.randn(8, 2, pl.module.weight.shape[1], generator=g)
            outs[str(pl.key)] = pl.module(x)[0].clone()
    return outs


def worker(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True, help="comma-separated names from LAYOUTS")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from snip_megatron.megatron import runtime

    rank, _ = runtime.init_process_group()
    for name in args.layouts.split(","):
        result = run_layout(*LAYOUTS[name])
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        with open(os.path.join(args.out, name, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    runtime.destroy(process_group=True)
    # Skip interpreter teardown: on CPU it idles ~5 s per launch; the results are on disk.
    sys.stdout.flush()
    os._exit(0)


def run_layout(tp: int, pp: int, vpp: "int | None") -> dict:
    """One rank: build with plan A, train, apply plan B at the step boundary, train on."""
    from snip_megatron.megatron import runtime

    runtime.initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, seed=1234)
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.megatron.apply import apply_plan, list_planned_linears, precision_of
    from snip_megatron.megatron.batch import make_forward_step, random_batch
    from snip_megatron.megatron.model import build_gpt_model, make_transformer_config
    from snip_megatron.megatron.quant_recipe import recipe_for_chunk
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape, wrap_ddp_and_optimizer
    from snip_megatron.models import gpt
    from snip_megatron.models.agree import agree

    n = shape.num_layers
    config = make_transformer_config(shape, tp=tp, pp=pp, vpp=vpp)
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        # The plan is keyed by global layer; each chunk's matcher knows its own layer offset.
        config.quant_recipe = recipe_for_chunk(plan_a(n), config, vp_stage=vp_stage)
        chunks.append(build_gpt_model(shape, config=config, backend="emulated", vp_stage=vp_stage))
    ddp_chunks, optimizer = wrap_ddp_and_optimizer(chunks, config, lr=3e-3, clip_grad=1.0,
                                                   distributed_optimizer=False)

    def precisions() -> dict:
        return {str(pl.key): precision_of(pl.module).value for pl in list_planned_linears(ddp_chunks)}

    generator = torch.Generator().manual_seed(7)
    batches = [random_batch(2, shape.seq_length, shape.vocab_size, generator) for _ in range(2)]
    forward_backward, forward_step, losses = get_forward_backward_func(), make_forward_step(), []

    def train(steps: int) -> None:
        for _ in range(steps):
            for chunk in ddp_chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            data = [iter(batches) for _ in ddp_chunks] if len(ddp_chunks) > 1 else iter(batches)
            reduced = forward_backward(forward_step_func=forward_step, data_iterator=data,
                                       model=ddp_chunks, num_microbatches=len(batches),
                                       seq_length=shape.seq_length, micro_batch_size=2,
                                       forward_only=False)
            optimizer.step()
            if ps.is_pipeline_last_stage(ignore_virtual=True):
                losses.append(sum(float(r["lm loss"]) for r in reduced) / len(reduced))

    build = precisions()
    train(STEPS_BEFORE)
    before = _linear_outputs(chunks)
    changes = apply_plan(ddp_chunks, plan_b(n))  # the step-k boundary, on every rank
    after_out = _linear_outputs(chunks)
    after = precisions()
    train(STEPS_AFTER)
    result = dict(
        rank=torch.distributed.get_rank(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        build=build, after=after, losses=losses,
        changes=[(str(c.key), c.old.value, c.new.value) for c in changes],
        out_changed={k: not torch.equal(before[k], after_out[k]) for k in before},
        paths={str(pl.key): [pl.chunk, pl.module_path] for pl in list_planned_linears(ddp_chunks)},
        weights={str(pl.key): list(pl.module.weight.shape) for pl in list_planned_linears(chunks)},
        local_inventory=[str(e.key) for e in gpt.discover(ddp_chunks)],
        inventory=[str(e.key) for e in agree(gpt.discover(ddp_chunks), expected=gpt.inventory(shape))])
    runtime.destroy()
    return result


if __name__ == "__main__":
    worker()


def test_gpu_check_script_logic_on_cpu(megatron_single, capsys):
    """bench/gpu/emulation_cuda_check.py is meant for a GPU; its logic is run here on CPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "emulation_cuda_check.py"
    spec = importlib.util.spec_from_file_location("emulation_cuda_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main(["--device", "cpu", "--tiny", "--steps-before", "1", "--steps-after", "3"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0, lines
    assert lines[-1].startswith("RESULT device=cpu world=1 linears=16 replanned=4 max_rel_err=0.00e+00")
    assert " fp4_recipes=nvfp4,mxfp4 trained=16/16 fused_wgrad=0 step_x=fp8:" in lines[-1]
    assert lines[-1].endswith("ok=1")
    assert any("only they changed output" in line for line in lines)
    assert any(line.startswith("plan B, fp4 mxfp4: cpu vs CPU") for line in lines)  # FP4 in both recipes
    assert any(line.startswith("step 1: 16/16 planned linears moved") for line in lines)
