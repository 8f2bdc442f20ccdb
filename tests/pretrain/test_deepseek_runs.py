"""A DeepSeek-style model (MLA + MoE + MTP: layers 2-4 and the MTP layer MoE, every MoE layer with a
shared expert) through Megatron-LM's loop with SNIP on CPU (prod lane) at PP=2 x VPP=2 on the local
spec (SequentialMLP experts, SNIP's emulated linears), saved and resumed; on Transformer Engine's
grouped experts at TP=2 with sequence parallelism x EP=2 and PP=2 x VPP=2, from SM90 to SM100:
tests/pretrain/test_moe_layouts.py. MoE latent projections on TE. (Statistics at these layouts equal
one process's: tests/stats/test_measure_moe_parallel.py.)"""

import pytest

from snip_megatron.plan import Plan
from tests.pretrain import test_mla_runs, test_runs
from tests.pretrain.test_layouts import analyzed, check_launch, check_ranks
from tests.pretrain.test_runs import needs_training, state_of
from tests.pretrain.test_te_runs import BLACKWELL_SNIP, DATA, HOPPER_SNIP, WORKER, run_te

pytestmark = pytest.mark.launches

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1,1,1]",
       "--moe-shared-expert-intermediate-size", "128", "--moe-aux-loss-coeff", "1e-2"]
DEEPSEEK = [*test_mla_runs.MLA, *MOE, "--mtp-num-layers", "1", "--num-layers", "4"]
ITERS = ["--global-batch-size", "8", "--train-iters", "6", "--save-interval", "3"]
"""Measure at step 2, plan at 3, save; resumed: measure at 5, plan at 6."""


@needs_training
def test_pipeline_with_virtual_stages_on_the_local_spec_measures_replans_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = [*DEEPSEEK, "--moe-ffn-hidden-size", "32", "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "1", *DATA, *ITERS, *BLACKWELL_SNIP, "--save", str(ckpt)]
    saved = test_runs.MODEL
    test_runs.MODEL = test_mla_runs.MODEL
    try:
        run = lambda *extra: test_runs.run(tmp_path, ["-m", "snip_megatron.pretrain"], *argv, *extra,  # noqa: E731
                                           nproc=2, timeout=900)
        check_launch(run("--exit-interval", "3"), [1, 2, 3])
        plan = Plan.from_dict(state_of(ckpt, 3)["plan"])
        assert {"2.expert_fc1", "4.shared_expert_fc2", "1.mtp.expert_fc2"} <= {str(k) for k in plan.keys()}
        assert plan.counts()["fp4"] > 0 and all(plan[k].value != "fp4" for k in plan.keys() if k.name.startswith("mtp."))
        check_launch(run("--load", str(ckpt)), [4, 5, 6], plan)
    finally:
        test_runs.MODEL = saved
    # snip-analyze of the checkpoint at PP=2 (it measures without virtual stages)
    analyzed(tmp_path, "a", ckpt, 6, [*DEEPSEEK, "--moe-ffn-hidden-size", "32", "--pipeline-model-parallel-size", "2"],
             sm=None, nproc=2, base=test_mla_runs.MODEL, kind="fp4_fraction")


@needs_training
def test_latent_moe_projections_are_planned_measured_and_replanned_on_te(tmp_path):
    """`--moe-latent-size` (Megatron builds the latent projections as TE linears duplicated over TP):
    each MoE layer's fc1_latent_proj and fc2_latent_proj are planned units around its experts (which
    work in the latent width), measured and re-planned over the TE double; every TE linear runs its
    plan. (On the local spec Megatron cannot build them: support rule moe-latent-local.)"""
    latent = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq",
              "[1,0]", "--moe-grouped-gemm", "--moe-latent-size", "32"]
    out = run_te(tmp_path, [str(WORKER), str(tmp_path / "p")], *latent, *DATA, "--global-batch-size", "8",
                 "--train-iters", "3", *HOPPER_SNIP, sm=90)
    check_launch(out, [1, 2, 3])
    rows = check_ranks(tmp_path / "p", 1, [1, 2, 3])
    assert list(rows[-1]["plan"])[:6] == ["1.linear_qkv", "1.linear_proj", "1.fc1_latent_proj", "1.expert_fc1",
                                          "1.expert_fc2", "1.fc2_latent_proj"]
    assert rows[0]["plan"] != rows[-1]["plan"]  # re-planned from the measurement
