"""The layout classes of the support matrix, combined as real runs combine them, through Megatron-LM's
loop (snip-pretrain-gpt) on CPU (prod lane): each launch starts with SNIP on, measures and re-plans;
chained launches save and resume, each starting from the checkpoint's plan.

On Transformer Engine (Megatron's TE spec over the TE double) one chain per model moves a run across
layouts and GPU generations: one process on an H100's SM90 (BF16/FP8 plans), then TP=2 with sequence
parallelism x PP=2 x VPP=2 on SM90, the same on a B200's SM100 (FP8/FP4 plans), then one process on
SM100; every TE linear of every rank runs its plan after every step (tests/pretrain/test_te_runs.py's
checks). On the emulated backend (Megatron's local spec with SNIP's linears; TP without sequence
parallelism, which the local spec's torch norms refuse): TP=2 x PP=2 x VPP=2, saved and resumed, the
dense GPT with an MTP layer.
Beside each: DP=2 with the distributed optimizer and full recompute, on each backend, one launch (not
resumed: Megatron's distributed optimizer cannot load a checkpoint without apex or TE's FusedAdam,
megatron/core/optimizer/distrib_optimizer.py `state_dict`, `assert len(steps) == 1`).
Models: the dense GPT, and MLA with an MTP layer."""

import pytest

from snip_megatron.plan import Plan
from tests.analyze.helpers import WORKER as ANALYZE_WORKER
from tests.pretrain import test_mla_runs, test_runs
from tests.pretrain.test_runs import losses, needs_training, snip_lines, state_of
from tests.pretrain.test_te_runs import (BLACKWELL_SNIP, DATA, HOPPER_SNIP, WORKER, check_linears_follow_the_plan,
                                         check_runtime, run_te, te_rows)

pytestmark = pytest.mark.launches

RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
DP2 = ["--use-distributed-optimizer", *RECOMPUTE]
"""DP=2 (two processes, no model parallelism) with the distributed optimizer and full recompute."""
PP2_VPP2 = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
MODELS = {  # name: (the model's flags, its features)
    "dense": (test_runs.MODEL, []),
    "mla_mtp": (test_mla_runs.MODEL, [*test_mla_runs.MLA, "--mtp-num-layers", "1"]),
}
HYBRID = "*-*-*-*-"
"""snip-pretrain-hybrid's model (TE only): 4 attention and 4 MLP layers, as a GPT of 4 layers;
its pipeline cuts the pattern in segments (`|`), one per stage and virtual chunk."""
TE_MODELS = {**MODELS, "hybrid": (test_runs.MODEL, [])}
EMULATED_MODELS = {"dense_mtp": (test_runs.MODEL, ["--mtp-num-layers", "1"]), "mla_mtp": MODELS["mla_mtp"]}
"""On the emulated backend the dense GPT carries an MTP layer (MTP without MLA at TP=2 is covered so)."""


def model_flags(model: str, layout: list) -> "tuple[list, dict]":
    """(the flags of `model` at `layout`, the worker's environment): a HybridModel takes its layer
    count from the pattern and its virtual pipeline from the pattern's segments (`|`), one per
    stage and virtual chunk (Megatron-LM refuses the GPT's flags for them)."""
    base, features = TE_MODELS[model]
    if model != "hybrid":
        return [*features, "--num-layers", "4", *layout], {}
    drop = {"--num-layers", "--num-layers-per-virtual-pipeline-stage"}
    kept, skip = [], False
    for arg in layout:  # the GPT's layer-count flags, each with its value
        if skip:
            skip = False
        elif arg in drop:
            skip = True
        else:
            kept.append(arg)
    segments = 4 if "--num-layers-per-virtual-pipeline-stage" in layout else 1
    pattern = "|".join(HYBRID[i * 8 // segments:(i + 1) * 8 // segments] for i in range(segments))
    return [*features, "--hybrid-layer-pattern", pattern, *kept], {"PROBE_FAMILY": "hybrid"}


ITERS = ["--global-batch-size", "8", "--train-iters", "12", "--save-interval", "3"]
"""Measurements at steps 2, 5, 8, 11 (warm-up 2, interval 3, lag 1), plans at 3, 6, 9, 12; a launch
of a chain runs three of them and saves."""


def replans(out: str) -> list[str]:
    return [line for line in snip_lines(out) if " measurement " in line and line.startswith("[snip] step ")]


def check_launch(out: str, steps: list[int], resumed: "Plan | None" = None) -> None:
    """The launch trained `steps` (losses in range), re-planned from one measurement, and, resumed,
    started from the checkpoint's plan."""
    assert sorted(losses(out)) == steps and all(2.0 < x < 7.0 for x in losses(out).values()), losses(out)
    assert len(replans(out)) == 1, snip_lines(out)
    if resumed is not None:
        assert any(line.endswith(f"plan: checkpoint {resumed.counts()}") for line in snip_lines(out)), snip_lines(out)


def check_ranks(probe, nproc: int, steps: list[int]) -> list[dict]:
    """Every rank ran `steps`, each of its TE linears as planned, under fused wgrad accumulation with
    the step's weights; every rank ends on one plan. Returns rank 0's rows."""
    plans = []
    for rank in range(nproc):
        rows = te_rows(probe, rank)
        assert [r["step"] for r in rows] == steps, (rank, rows)
        check_linears_follow_the_plan(rows)
        check_runtime(rows)
        plans.append(rows[-1]["plan"])
    assert all(p == plans[0] for p in plans), plans
    return te_rows(probe, 0)


def analyzed(tmp_path, name: str, ckpt, step: int, flags: list, *, sm: "int | None", nproc: int, base: list,
             kind: str) -> None:
    """snip-analyze of the checkpoint a chain just saved, with the run's flags `flags` (its model and
    layout; VPP dropped: snip-analyze measures at one process, TP, PP and EP), on SM`sm` (None: the
    emulated backend): it measures the checkpoint's step and writes a plan at the run's budget kind."""
    import json

    drop = {"--num-layers-per-virtual-pipeline-stage"}
    flags = [a for i, a in enumerate(flags) if a not in drop and (i == 0 or flags[i - 1] not in drop)]
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1]) if "--pipeline-model-parallel-size" in flags else 1
    flags = [stage_segments(a, pp) if i and flags[i - 1] == "--hybrid-layer-pattern" else a
             for i, a in enumerate(flags)]
    snip = HOPPER_SNIP if sm == 90 else BLACKWELL_SNIP
    argv = [*flags, *DATA, "--global-batch-size", "8", "--load", str(ckpt), "--out", str(tmp_path / name),
            "--budgets", "0.5", "--analyze-microbatches", "2", *snip[1:]]
    if sm is None:
        out = emulated(tmp_path, base, *argv, nproc=nproc, module="snip_megatron.analyze")
    else:  # snip-analyze over the TE double, which stands in for the GPU of SM`sm`
        out = run_te(tmp_path, [str(ANALYZE_WORKER), str(tmp_path / name / "record")], *argv, sm=sm, nproc=nproc,
                     timeout=900, model=base)
    assert f"[snip-analyze] {ckpt} at step {step}:" in out, out[-3000:]
    doc = json.loads((tmp_path / name / "analysis.json").read_text())
    assert doc["budget_kind"] == kind and doc["plans"][0]["error"] is None, doc["plans"]


def stage_segments(pattern: str, pp: int) -> str:
    """A HybridModel's pattern with one segment per pipeline stage: its segments (one per virtual
    chunk, in layer order) joined in order, the same layers without the virtual pipeline."""
    segments = pattern.split("|")
    per_stage = len(segments) // pp
    return "|".join("".join(segments[i * per_stage:(i + 1) * per_stage]) for i in range(pp))


def emulated(tmp_path, model: list, *argv: str, nproc: int, module: str = "snip_megatron.pretrain") -> str:
    saved = test_runs.MODEL
    test_runs.MODEL = model  # test_runs.run takes the model's flags from there
    try:
        return test_runs.run(tmp_path, ["-m", module], *argv, nproc=nproc, timeout=900)
    finally:
        test_runs.MODEL = saved


@needs_training
@pytest.mark.parametrize("model", sorted(TE_MODELS))
def test_te_chain_across_layouts_and_generations(tmp_path, model):
    """One process (SM90) -> TP=2+SP x PP=2 x VPP=2 (SM90) -> the same (SM100) -> one process (SM100);
    snip-analyze measures each link's checkpoint on its GPU (at TP=2+SP x PP=2 after the 4-process links)."""
    base = TE_MODELS[model][0]
    ckpt = tmp_path / "ckpt"
    tp_pp = ["--tensor-model-parallel-size", "2", "--sequence-parallel", *PP2_VPP2]
    links = [(1, [], 90), (4, tp_pp, 90), (4, tp_pp, 100), (1, [], 100)]
    plan = None
    for i, (nproc, layout, sm) in enumerate(links):
        steps = [3 * i + 1, 3 * i + 2, 3 * i + 3]
        probe = tmp_path / f"p{i}"
        flags, env = model_flags(model, layout)
        argv = [*flags, *DATA, *ITERS, "--save", str(ckpt), "--exit-interval", str(steps[-1]),
                *(HOPPER_SNIP if sm == 90 else BLACKWELL_SNIP), *(["--load", str(ckpt)] if plan else [])]
        out = run_te(tmp_path, [str(WORKER), str(probe)], *argv, sm=sm, nproc=nproc, timeout=900, model=base, **env)
        check_launch(out, steps, plan)
        rows = check_ranks(probe, nproc, steps)
        if model == "dense" and nproc == 4:  # Megatron's interleaved chunks, keyed by global layer
            assert {rank: {int(k.split(".")[0]) for k in te_rows(probe, rank)[-1]["linears"]}
                    for rank in range(4)} == {0: {1, 3}, 1: {1, 3}, 2: {2, 4}, 3: {2, 4}}
        if plan is not None:
            assert rows[0]["plan"] == {str(k): p.value for k, p in plan.items()}
        plan = Plan.from_dict(state_of(ckpt, steps[-1])["plan"])
        assert plan.counts()["bf16" if sm == 90 else "fp4"] > 0, plan.counts()  # the generation's plan
        analyzed(tmp_path, f"a{i}", ckpt, steps[-1], flags, sm=sm, nproc=nproc, base=base,
                 kind="fp8_fraction" if sm == 90 else "fp4_fraction")


@needs_training
@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize("model", sorted(TE_MODELS))
def test_te_data_parallel_with_the_distributed_optimizer_and_recompute(tmp_path, model, sm):
    flags, env = model_flags(model, DP2)
    argv = [*flags, *DATA, *ITERS, "--exit-interval", "3", *(HOPPER_SNIP if sm == 90 else BLACKWELL_SNIP)]
    out = run_te(tmp_path, [str(WORKER), str(tmp_path / "p")], *argv, sm=sm, nproc=2, timeout=900,
                 model=TE_MODELS[model][0], **env)
    check_launch(out, [1, 2, 3])
    rows = check_ranks(tmp_path / "p", 2, [1, 2, 3])
    assert any(p == ("bf16" if sm == 90 else "fp4") for p in rows[-1]["plan"].values())


@needs_training
@pytest.mark.parametrize("model", sorted(EMULATED_MODELS))
def test_emulated_model_and_pipeline_parallelism_measure_replan_and_resume(tmp_path, model):
    """TP=2 x PP=2 x VPP=2 (MLA: PP=2 x VPP=2; Megatron's MLA needs SP at TP > 1), saved and resumed."""
    base, features = EMULATED_MODELS[model]
    layout, nproc = (PP2_VPP2, 2) if model == "mla_mtp" else (["--tensor-model-parallel-size", "2", *PP2_VPP2], 4)
    ckpt = tmp_path / "ckpt"
    argv = [*features, *layout, *DATA, *ITERS, *BLACKWELL_SNIP, "--save", str(ckpt)]
    check_launch(emulated(tmp_path, base, *argv, "--exit-interval", "3", nproc=nproc), [1, 2, 3])
    plan = Plan.from_dict(state_of(ckpt, 3)["plan"])
    assert plan.counts()["fp4"] > 0
    check_launch(emulated(tmp_path, base, *argv, "--load", str(ckpt), "--exit-interval", "6", nproc=nproc),
                 [4, 5, 6], plan)
    analyzed(tmp_path, "a", ckpt, 6, [*features, *layout], sm=None, nproc=nproc, base=base, kind="fp4_fraction")


@needs_training
@pytest.mark.parametrize("model", sorted(EMULATED_MODELS))
def test_emulated_data_parallel_with_the_distributed_optimizer_and_recompute(tmp_path, model):
    base, features = EMULATED_MODELS[model]
    out = emulated(tmp_path, base, *features, *DP2, *DATA, *ITERS, *BLACKWELL_SNIP, "--exit-interval", "3", nproc=2)
    check_launch(out, [1, 2, 3])
