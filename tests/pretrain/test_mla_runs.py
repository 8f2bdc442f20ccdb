"""Megatron-LM's loop trains a multi-latent-attention GPT and a multi-token-prediction GPT with SNIP
on the CPU (prod lane). MLA: every MLA linear planned (linear_q_proj, or the q down/up-projections;
the kv down/up-projections; linear_proj), measured and re-planned at one process with an MTP layer
(and resumed with the checkpoint's plan), at TP=2 with sequence parallelism (Megatron's TE spec over
the TE double; resumed), and at PP=2 with a budget per stage (without q_lora_rank, with an MTP layer, resumed).
MTP (--mtp-num-layers 1): its eh_proj and inner layer's linears keyed "mtp.<name>" by depth, never
FP4 (as Megatron), measured, re-planned and resumed at one process and at PP=2 (with MLA) and at TP=2
(Megatron's TE spec over the TE double).
(Statistics at TP=2+SP and PP=2 equal one process's: tests/stats/test_measure_mla.py.)"""

import json
import re

import pytest

from snip_megatron.plan import Plan
from tests.distributed import ROOT, run_distributed
from tests.forked import MEGATRON_LM
from tests.pretrain import test_runs
from tests.pretrain.test_runs import losses, needs_training, snip_lines, state_of

pytestmark = pytest.mark.launches

# the GPT of test_runs without grouped-query attention, which Megatron refuses with MLA
GQA = ("--group-query-attention", "--num-query-groups")
MODEL = [a for i, a in enumerate(test_runs.MODEL)
         if a not in GQA and test_runs.MODEL[i - 1] != "--num-query-groups"]


PROBED = ROOT / "tests" / "pretrain" / "pretrain_worker.py"


def train(cwd, *argv, probe=None, **kw):
    """test_runs.train on MODEL; with `probe`, through pretrain_worker.py writing there."""
    saved = test_runs.MODEL
    test_runs.MODEL = MODEL
    try:
        if probe is None:
            return test_runs.train(cwd, *argv, **kw)
        return test_runs.run(cwd, [str(PROBED), str(probe)], *argv, **kw)
    finally:
        test_runs.MODEL = saved

MLA = ["--multi-latent-attention", "--kv-lora-rank", "48", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "16",
       "--v-head-dim", "16", "--rope-type", "rope"]
Q_LORA = ["--q-lora-rank", "32"]
SNIP = ["--mock-data", "--vocab-size", "256", "--eval-interval", "100", "--snip", "--snip-warmup", "1",
        "--snip-interval", "2", "--snip-lag", "0", "--snip-fp4-budget", "0.5"]
PER_LAYER = {"q_lora": ["linear_q_down_proj", "linear_kv_down_proj", "linear_q_up_proj", "linear_kv_up_proj",
                        "linear_proj", "linear_fc1", "linear_fc2"],
             "no_q_lora": ["linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
                           "linear_fc1", "linear_fc2"]}


def mtp_losses(out: str) -> dict[int, float]:
    """Megatron's logged MTP loss per iteration: the training step's alone, also at a measured step
    (SNIP's measurement passes leave Megatron's MTP loss tracker as they found it)."""
    return {int(m.group(1)): float(m.group(2)) for m in
            re.finditer(r"iteration\s+(\d+)/\s*\d+ .*?mtp_1 loss: ([0-9.E+-]+)", out)}


def replans(out: str) -> list[str]:
    return [line for line in snip_lines(out) if re.match(r"\[snip\] step [1-9]\d*: plan .* measurement", line)]


@needs_training
def test_one_process_measures_replans_and_resumes_the_checkpoint_plan(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = [*MLA, *Q_LORA, *SNIP, "--mtp-num-layers", "1", "--train-iters", "4", "--save-interval", "2",
              "--save", str(ckpt)]
    out = train(tmp_path, *common, "--exit-interval", "2")
    mtp = ["mtp.eh_proj"] + ["mtp." + n for n in PER_LAYER["q_lora"]]
    assert f"[snip] {len(mtp)} multi-token-prediction linears planned in BF16/FP8, never FP4" in out
    assert "[snip] rank 0 runs the plan on its 22 planned linears: {'bf16': 0, 'fp8': 22, 'fp4': 0}" in snip_lines(out)
    assert len(replans(out)) == 1 and sorted(losses(out)) == [1, 2]
    assert sorted(mtp_losses(out)) == [1, 2] and all(2.0 < x < 7.0 for x in mtp_losses(out).values())
    state = state_of(ckpt, 2)
    plan = Plan.from_dict(state["plan"])
    assert sorted({k.name for k in plan.keys()}) == sorted(PER_LAYER["q_lora"] + mtp)
    assert plan.counts()["fp4"] > 0  # the re-plan put some MLA linears in FP4 ...
    assert {p.value for k, p in plan.items() if k.name.startswith("mtp.")} <= {"bf16", "fp8"}  # ... no MTP one
    out = train(tmp_path, *common, "--load", str(ckpt))
    assert any(line.endswith(f"plan: checkpoint {plan.counts()}") for line in snip_lines(out)), snip_lines(out)
    assert sorted(losses(out)) == [3, 4] and len(replans(out)) == 1


@needs_training
def test_tp2_sp_over_the_te_double_measures_replans_and_resumes(tmp_path):
    """Megatron's TE spec: the down-projections are TELinear(parallel_mode="duplicated"), measured
    through their unfused GEMM on this rank's tokens (the CPU's torch norms refuse SP; TE's do not);
    the resumed run builds every rank's TE linears, duplicated ones included, with the checkpoint's plan."""
    from tests.pretrain.test_te_runs import DATA, TE, WORKER, te_built, te_env

    ckpt = tmp_path / "ckpt"
    common = [*MODEL, *TE, *MLA, *Q_LORA, *DATA, *SNIP[5:], "--tensor-model-parallel-size", "2",
              "--sequence-parallel", "--train-iters", "3", "--save", str(ckpt), "--save-interval", "2"]
    out = run_distributed([str(WORKER), str(tmp_path / "p"), *common, "--exit-interval", "2"],
                          nproc=2, timeout=600, env=te_env(100), preload=MEGATRON_LM).stdout
    planned = json.loads((tmp_path / "p" / "rank0.json").read_text())["planned"]
    assert sorted(planned) == sorted(f"{layer}.{n}" for layer in (1, 2) for n in PER_LAYER["q_lora"])
    assert {planned[f"1.{n}"] for n in ("linear_q_down_proj", "linear_kv_down_proj")} == {"TELinear"}
    assert len(replans(out)) == 1 and sorted(losses(out)) == [1, 2]  # measured at step 1
    plan = Plan.from_dict(state_of(ckpt, 2)["plan"])
    assert plan.counts()["fp4"] > 0
    out = run_distributed([str(WORKER), str(tmp_path / "q"), *common, "--load", str(ckpt)],
                          nproc=2, timeout=600, env=te_env(100), preload=MEGATRON_LM).stdout
    assert any(line.endswith(f"plan: checkpoint {plan.counts()}") for line in snip_lines(out)), snip_lines(out)
    for rank in (0, 1):
        assert te_built(tmp_path / "q", rank) == {str(k): p.value for k, p in plan.items()}
    assert sorted(losses(out)) == [3] and len(replans(out)) == 1  # measured at step 3


@needs_training
def test_pp2_with_mtp_measures_replans_per_stage_and_resumes(tmp_path):
    """The MTP layer is built on the last stage, which embeds the tokens again: its batch carries
    tokens and positions (Megatron's `mtp_on_this_rank`, as Megatron-LM's get_batch); its linears
    count in the last stage's budget."""
    ckpt, probe = tmp_path / "ckpt", tmp_path / "probe"
    common = [*MLA, *SNIP, "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2",
              "--snip-per-stage-budget", "--train-iters", "3", "--save-interval", "2", "--save", str(ckpt),
              "--snip-fp4-budget", "0.4"]  # at most 46% of the last stage can run FP4: its MTP linears never do
    out = train(tmp_path, *common, "--exit-interval", "2", probe=probe, nproc=2)
    names = PER_LAYER["no_q_lora"]
    mtp = ["mtp.eh_proj"] + ["mtp." + n for n in names]
    assert f"[snip] {len(mtp)} multi-token-prediction linears planned in BF16/FP8, never FP4" in out
    assert f"[snip] rank 0 runs the plan on its {len(names)} planned linears" in out
    first, last = (json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1))
    assert sorted(first["planned"]) == sorted(f"1.{n}" for n in names)
    assert sorted(last["planned"]) == sorted([f"2.{n}" for n in names] + [f"1.{n}" for n in mtp])
    assert first["stages"] == {**{f"1.{n}": 0 for n in names}, **{f"2.{n}": 1 for n in names},
                               **{f"1.{n}": 1 for n in mtp}}
    assert len(replans(out)) == 1 and sorted(losses(out)) == [1, 2] and sorted(mtp_losses(out)) == [1, 2]
    assert all(2.0 < x < 7.0 for x in [*losses(out).values(), *mtp_losses(out).values()])
    plan = Plan.from_dict(state_of(ckpt, 2)["plan"])
    assert sorted(str(k) for k in plan.keys()) == sorted(first["stages"])
    assert plan.counts()["fp4"] > 0 and {p.value for k, p in plan.items() if k.name.startswith("mtp.")} <= {"bf16", "fp8"}
    out = train(tmp_path, *common, "--load", str(ckpt), nproc=2)
    assert any(line.endswith(f"plan: checkpoint {plan.counts()}") for line in snip_lines(out)), snip_lines(out)
    assert sorted(losses(out)) == [3] and len(replans(out)) == 1  # measured at step 3


