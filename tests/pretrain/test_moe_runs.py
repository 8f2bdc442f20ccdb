"""Megatron-LM's loop trains an MoE GPT with SNIP on the CPU (prod lane): `--num-experts 4
--moe-router-topk 2` on Megatron's local spec, layer 1 MoE (SequentialMLP experts, SNIP's emulated
linears) and layer 2 dense (`--moe-layer-freq`), at one process. Each layer's routed experts are one
planned unit per linear (expert_fc1/expert_fc2), measured (routing frozen, router state untouched:
tests/stats/test_measure_moe.py), re-planned, saved and resumed with the checkpoint's plan."""

import re

import pytest

from snip_megatron.plan import Plan
from tests.pretrain.test_runs import ROOT, losses, needs_training, run, snip_lines, state_of, train

pytestmark = pytest.mark.launches

PROBED = ROOT / "tests" / "pretrain" / "pretrain_worker.py"

ROUTED = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2"]
MOE = [*ROUTED, "--moe-layer-freq", "[1,0]"]
SNIP = ["--mock-data", "--vocab-size", "256", "--eval-interval", "100", "--snip", "--snip-warmup", "1",
        "--snip-interval", "2", "--snip-lag", "0", "--snip-fp4-budget", "0.5"]


def replans(out: str) -> list[str]:
    return [line for line in snip_lines(out) if re.match(r"\[snip\] step [1-9]\d*: plan .* measurement", line)]


@needs_training
def test_one_process_moe_measures_replans_and_resumes_the_checkpoint_plan(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = [*MOE, *SNIP, "--train-iters", "4", "--save-interval", "2", "--save", str(ckpt)]
    out = train(tmp_path, *common, "--exit-interval", "2")
    assert any(line.startswith("[snip] MoE: 2 routed-expert units planned") and "decoder.layers.*.mlp.router" in line
               for line in snip_lines(out)), snip_lines(out)
    assert "[snip] rank 0 runs the plan on its 8 planned linears: {'bf16': 0, 'fp8': 8, 'fp4': 0}" in snip_lines(out)
    assert len(replans(out)) == 1 and sorted(losses(out)) == [1, 2]
    assert "load_balancing_loss" in out  # Megatron's aux loss still trains and logs
    plan = Plan.from_dict(state_of(ckpt, 2)["plan"])
    assert [str(k) for k in plan.keys()] == ["1.linear_qkv", "1.linear_proj", "1.expert_fc1", "1.expert_fc2",
                                             "2.linear_qkv", "2.linear_proj", "2.linear_fc1", "2.linear_fc2"]
    assert plan.counts()["fp4"] > 0
    out = train(tmp_path, *common, "--load", str(ckpt))
    assert any(line.endswith(f"plan: checkpoint {plan.counts()}") for line in snip_lines(out)), snip_lines(out)
    assert sorted(losses(out)) == [3, 4] and len(replans(out)) == 1


@needs_training
def test_moe_with_full_activation_recompute_measures_and_replans(tmp_path):
    """Full recompute (the 70B setting) over the MoE layer: the measurement's statistics come from
    the recomputed forward, routing frozen (tests/stats/test_measure_moe_parallel.py), and the run
    re-plans and trains on."""
    out = train(tmp_path, *MOE, *SNIP, "--train-iters", "3", "--recompute-granularity", "full",
                "--recompute-method", "uniform", "--recompute-num-layers", "1")
    assert len(replans(out)) == 2 and sorted(losses(out)) == [1, 2, 3]  # measured at steps 1 and 3
    assert " 0.0% of linear FLOPs" not in replans(out)[0]  # the re-plan put linears in FP4
    assert all(loss == loss and loss < 10 for loss in losses(out).values()), losses(out)


@needs_training
def test_te_grouped_moe_trains_measures_replans_and_resumes_over_the_te_double(tmp_path):
    """`--transformer-impl transformer_engine --moe-grouped-gemm` (TEGroupedMLP over the TE double's
    GroupedLinear, standing in for an H100): each layer's grouped expert_fc1/fc2 is a planned unit
    that runs its planned recipe (blockwise FP8 needs SNIP's split padding: TE refuses unaligned
    splits), switched at a step boundary by the re-plan, fused wgrad into every expert's main_grad;
    saved and resumed with the checkpoint's plan."""
    from tests.pretrain.test_te_runs import check_linears_follow_the_plan, check_runtime, probed, te_rows

    ckpt = tmp_path / "ckpt"
    common = [*MOE, "--moe-grouped-gemm", "--mock-data", "--vocab-size", "256", "--eval-interval", "100",
              "--snip", "--snip-warmup", "1", "--snip-interval", "2", "--snip-lag", "0", "--snip-fp8-budget", "0.5",
              "--save-interval", "2", "--save", str(ckpt), "--train-iters", "3"]
    out = probed(tmp_path, tmp_path / "p", *common, "--exit-interval", "2", sm=90)
    assert "[snip] rank 0 runs the plan on its 8 planned linears: {'bf16': 0, 'fp8': 8, 'fp4': 0}" in snip_lines(out)
    assert len(replans(out)) == 1 and sorted(losses(out)) == [1, 2]
    rows = te_rows(tmp_path / "p")
    assert [r["step"] for r in rows] == [1, 2]
    check_linears_follow_the_plan(rows)
    check_runtime(rows)
    # the re-plan at step 1 switched a grouped expert linear from FP8 (the initial plan) to BF16
    assert any(rows[0]["plan"][k] == "bf16" for k in ("1.expert_fc1", "1.expert_fc2")), rows[0]["plan"]
    plan = Plan.from_dict(state_of(ckpt, 2)["plan"])
    assert {str(k) for k in plan.keys()} >= {"1.expert_fc1", "1.expert_fc2"}
    out = probed(tmp_path, tmp_path / "q", *common, "--load", str(ckpt), sm=90)
    assert any(line.endswith(f"plan: checkpoint {plan.counts()}") for line in snip_lines(out)), snip_lines(out)
    assert sorted(losses(out)) == [3]
    rows = te_rows(tmp_path / "q")
    assert rows[0]["plan"] == {str(k): p.value for k, p in plan.items()}
    check_linears_follow_the_plan(rows)
    check_runtime(rows)


# Each layout on two processes: EP=2 over two data-parallel replicas, with Megatron's allgather
# dispatcher (the default) and with its alltoall one; expert TP 2 at TP 1 (each expert's linears
# sharded over the two replicas, which the dispatcher gathers every token for); and PP=2 (the MoE
# layer on the first stage, the dense one on the second; DP=1). Expert gradients are reduced by
# Megatron's DDP over the expert-data-parallel group. TP > 1 cannot run here: Megatron's MoE layer
# trains at TP > 1 only with sequence parallelism, which the local spec's torch norms refuse (its
# statistics are tested in tests/stats/test_measure_moe_parallel.py).
A2A = ["--moe-token-dispatcher-type", "alltoall"]
LAYOUTS = {
    "ep2": ["--expert-model-parallel-size", "2"],
    "ep2_a2a": ["--expert-model-parallel-size", "2", *A2A],
    "etp2": ["--expert-tensor-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


def check_local_experts(probe, layout: str, nproc: int = 2) -> None:
    """Each rank's MoE layer holds the model's 4 experts, or 2 at EP=2, behind the dispatcher and
    at the expert TP the flags name (Megatron's expert groups set up as the flags say)."""
    import json

    for rank in range(nproc):
        found = json.loads((probe / f"rank{rank}.json").read_text())
        if "pp2" in layout and rank == 1:  # the MoE layer is on the first stage
            assert found["local_experts"] == [], found
            continue
        assert found["local_experts"] == [2 if "ep2" in layout else 4], (rank, found)
        dispatcher = "MoEAlltoAllTokenDispatcher" if "a2a" in layout else "MoEAllGatherTokenDispatcher"
        assert found["dispatchers"] == [dispatcher], (rank, found)
        assert found["expert_tp"] == (2 if "etp2" in layout else 1), (rank, found)


@needs_training
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_moe_measures_replans_and_resumes_the_checkpoint_plan(tmp_path, layout):
    ckpt = tmp_path / "ckpt"
    common = [*MOE, *SNIP, *LAYOUTS[layout], "--train-iters", "3", "--save-interval", "2", "--save", str(ckpt)]
    out = run(tmp_path, [str(PROBED), str(tmp_path / "p")], *common, "--exit-interval", "2", nproc=2)
    assert len(replans(out)) == 1 and sorted(losses(out)) == [1, 2], snip_lines(out)
    assert all(2.0 < x < 7.0 for x in losses(out).values())
    check_local_experts(tmp_path / "p", layout)
    plan = Plan.from_dict(state_of(ckpt, 2)["plan"])
    assert [str(k) for k in plan.keys()][2:4] == ["1.expert_fc1", "1.expert_fc2"] and plan.counts()["fp4"] > 0
    out = train(tmp_path, *common, "--load", str(ckpt), nproc=2)
    assert any(line.endswith(f"plan: checkpoint {plan.counts()}") for line in snip_lines(out)), snip_lines(out)
    assert sorted(losses(out)) == [3] and len(replans(out)) == 1


# TE grouped experts over the TE double on four processes: TP=2 with sequence parallelism over two
# replicas, the experts on expert TP 2 x EP=2 behind the alltoall dispatcher (each rank two experts'
# halves; the dispatcher's all-to-all over EP, then its gather over expert TP of each rank's own
# token count), in the GPT (layer 1 MoE) and in a HybridModel '*E' (snip-pretrain-hybrid). TP=2+SP x
# EP=2 and PP=2 x VPP=2 (expert TP 1) are tests/pretrain/test_moe_layouts.py's chains; EP=2 over two
# replicas its DP=2 runs.
WIDE = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
        "--expert-tensor-parallel-size", "2", *A2A, "--global-batch-size", "8"]
TE_MODELS = {  # name -> (the model's flags, the worker's environment, its routed experts' keys)
    "gpt": ([*MOE, "--moe-grouped-gemm"], {}, ("1.expert_fc1", "1.expert_fc2")),
    "hybrid": (["--hybrid-layer-pattern", "*E", *ROUTED, "--moe-grouped-gemm"], {"PROBE_FAMILY": "hybrid"},
               ("2.expert_fc1", "2.expert_fc2")),
}


@needs_training
@pytest.mark.parametrize("model", sorted(TE_MODELS))
def test_te_grouped_experts_at_tp2_sp_etp2_ep2_alltoall_train_on_hopper_and_resume_on_blackwell(tmp_path, model):
    """As the one-process TE grouped run, on four processes: every rank's planned TE linears (its
    local experts' grouped linear halves included) run their planned recipe, switched by the re-plan
    at step 1 from the measurement (SM90: BF16/FP8); the resumed run, on SM100, builds every rank's
    linears with the checkpoint's plan and re-plans under an FP4 budget at its step."""
    from tests.pretrain.test_te_runs import check_linears_follow_the_plan, check_runtime, probed, te_built, te_rows

    ckpt = tmp_path / "ckpt"
    flags, env, experts = TE_MODELS[model]
    common = [*flags, *WIDE, "--mock-data", "--vocab-size", "256", "--eval-interval", "100", "--snip",
              "--snip-warmup", "1", "--snip-interval", "2", "--snip-lag", "0", "--save-interval", "2",
              "--save", str(ckpt), "--train-iters", "3"]
    out = probed(tmp_path, tmp_path / "p", *common, "--snip-fp8-budget", "0.5", "--exit-interval", "2", sm=90,
                 nproc=4, **env)
    assert len(replans(out)) == 1 and sorted(losses(out)) == [1, 2], snip_lines(out)
    assert all(2.0 < x < 7.0 for x in losses(out).values())
    check_local_experts(tmp_path / "p", "ep2_a2a_etp2", 4)
    for rank in range(4):
        rows = te_rows(tmp_path / "p", rank)
        assert [r["step"] for r in rows] == [1, 2]
        check_linears_follow_the_plan(rows)
        check_runtime(rows)
        assert set(experts) <= rows[0]["linears"].keys(), rows[0]["linears"]
    # the measured re-plan at step 1 put a grouped expert linear in BF16 (the initial plan is all FP8)
    assert any(te_rows(tmp_path / "p", 0)[0]["plan"][k] == "bf16" for k in experts)
    plan = Plan.from_dict(state_of(ckpt, 2)["plan"])
    saved = {str(k): p.value for k, p in plan.items()}
    out = probed(tmp_path, tmp_path / "q", *common, "--snip-fp4-budget", "0.5", "--load", str(ckpt), sm=100,
                 nproc=4, **env)
    assert any(line.endswith(f"plan: checkpoint {plan.counts()}") for line in snip_lines(out)), snip_lines(out)
    assert sorted(losses(out)) == [3] and len(replans(out)) == 1
    for rank in range(4):
        built = te_built(tmp_path / "q", rank)
        assert built and all(saved[k] == p for k, p in built.items()), (rank, built, saved)
        rows = te_rows(tmp_path / "q", rank)  # step 3 runs the SM100 re-plan of its measurement (lag 0)
        check_linears_follow_the_plan(rows)
        check_runtime(rows)
