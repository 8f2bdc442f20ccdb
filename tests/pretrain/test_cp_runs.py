"""Megatron-LM's loop with SNIP at context parallelism CP=2 on CPU (prod lane), over the TE test
double, whose DotProductAttention computes TE's cp_comm_type 'p2p' attention (Megatron's default):
each rank's queries over the whole sequence's keys and values, with Megatron's load-balanced split
(tests/te/double_checks.py checks it against one process). Two processes, Megatron's TE spec,
`--context-parallel-size 2`: trained on an H100's (SM90: BF16/FP8 plans) with a measured re-plan
and a save, resumed on a B200's (SM100: FP8/FP4 plans) with the checkpoint's plan and re-planned
again. Every TE linear of both ranks runs its plan after every step with that step's weights and
gradients (tests/pretrain/test_te_runs.py's checks), and every core attention attended its 16 of
the 32 tokens against all 32 keys. Models: the dense GPT (GQA), MLA with an MTP layer, a
HybridModel '*E*-' (attention, MoE, attention, MLP), and an MoE GPT on TE grouped experts (4 experts, top-2, every layer; each CP
rank's experts run its own tokens, gathered over CP while measured: stats/expert_rows.py). (The
statistics at CP=2 equal one process's: tests/stats/test_measure_te.py, and with grouped experts
tests/stats/test_measure_moe_parallel.py.)"""

import pytest

from snip_megatron.plan import Plan
from tests.distributed import run_distributed
from tests.forked import MEGATRON_LM
from tests.pretrain import test_mla_runs
from tests.pretrain.test_moe_layouts import EXPERTS
from tests.pretrain.test_runs import MODEL, losses, needs_training, snip_lines, state_of
from tests.pretrain.test_te_runs import (BLACKWELL_SNIP, DATA, HOPPER_SNIP, TE, WORKER, check_linears_follow_the_plan,
                                         check_runtime, te_env, te_rows)

pytestmark = pytest.mark.launches

CP = ["--context-parallel-size", "2"]
MODELS = {"dense": MODEL, "mla_mtp": [*test_mla_runs.MODEL, *test_mla_runs.MLA, "--mtp-num-layers", "1"],
          "hybrid": [*MODEL, *EXPERTS, "--hybrid-layer-pattern", "*E*-"], "moe": [*MODEL, *EXPERTS]}
ENV = {"hybrid": {"PROBE_FAMILY": "hybrid"}}
"""The worker runs snip-pretrain-hybrid for a HybridModel."""
SCHEDULE = [*DATA, "--train-iters", "6", "--save-interval", "3"]
"""Measure at step 2, plan at step 3, save; resumed: measure at step 5, plan at step 6."""


def launch(probe, model: str, *argv: str, sm: int) -> str:
    """snip-pretrain-gpt (-hybrid) through the probe worker on two processes over the doubles (SM`sm`)."""
    return run_distributed([str(WORKER), str(probe), *MODELS[model], *TE, *CP, *argv], nproc=2, timeout=900,
                           env=te_env(sm, **ENV.get(model, {})), preload=MEGATRON_LM).stdout


def check_trained(out: str, steps: list[int]) -> None:
    assert sorted(losses(out)) == steps, losses(out)
    assert all(4.0 < x < 6.5 for x in losses(out).values()), losses(out)  # ln(256) = 5.55 at the start
    replans = [line for line in snip_lines(out) if line.startswith("[snip] step ") and " measurement " in line]
    assert len(replans) == 1, snip_lines(out)


def check_ranks(probe, steps: list[int]) -> list[dict]:
    """Both CP ranks ran `steps`, each TE linear as planned with fresh weights and gradients under
    fused wgrad accumulation, each core attention over CP=2 (16 query tokens, 32 keys); both ran
    one plan. Returns rank 0's rows."""
    plans = []
    for rank in (0, 1):
        rows = te_rows(probe, rank)
        assert [r["step"] for r in rows] == steps, (rank, rows)
        check_linears_follow_the_plan(rows)
        check_runtime(rows)
        for row in rows:
            # every core attention (the decoder's two, and an MTP layer's)
            assert len(row["attention"]) >= 2 and all(v == [2, 16, 32] for v in row["attention"].values()), row
        plans.append(rows[-1]["plan"])
    assert plans[0] == plans[1], plans
    return te_rows(probe, 0)


@needs_training
@pytest.mark.parametrize("model", sorted(MODELS))
def test_cp2_measures_replans_on_hopper_and_resumes_on_blackwell(tmp_path, model):
    ckpt = tmp_path / "ckpt"
    common = [*SCHEDULE, "--save", str(ckpt)]
    out = launch(tmp_path / "p", model, *common, *HOPPER_SNIP, "--exit-interval", "3", sm=90)
    check_trained(out, [1, 2, 3])
    plan = Plan.from_dict(state_of(ckpt, 3)["plan"])
    assert plan.counts()["bf16"] > 0 and plan.counts()["fp4"] == 0  # the Hopper re-plan (from all FP8)
    rows = check_ranks(tmp_path / "p", [1, 2, 3])
    assert rows[-1]["plan"] == {str(k): p.value for k, p in plan.items()}
    # the grouped experts (both GPT layers', the hybrid's E layer's): planned units, measured and run as planned
    experts = {"moe": (1, 2), "hybrid": (2,)}.get(model, ())
    assert {f"{i}.expert_fc{j}" for i in experts for j in (1, 2)} <= rows[-1]["linears"].keys(), rows[-1]
    out = launch(tmp_path / "q", model, *common, *BLACKWELL_SNIP, "--load", str(ckpt), sm=100)
    assert any(line.endswith(f"plan: checkpoint {plan.counts()}") for line in snip_lines(out)), snip_lines(out)
    check_trained(out, [4, 5, 6])
    rows = check_ranks(tmp_path / "q", [4, 5, 6])
    assert rows[0]["plan"] == {str(k): p.value for k, p in plan.items()}  # the checkpoint's plan, then FP4
    assert any(p == "fp4" for p in rows[-1]["plan"].values())
