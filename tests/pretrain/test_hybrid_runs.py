"""snip-pretrain-hybrid (Megatron-LM's pretrain_hybrid.py main with SNIP) on CPU over the TE double
(Megatron's hybrid layer spec is TE-only), standing in for an H100: a HybridModel of
--hybrid-layer-pattern trains, SNIP measures and re-plans its attention (`*`) and MLP (`-`) layers,
keyed by hybrid layer number, every TE linear runs its plan after every step, and the plan is saved
and resumed. Runs: one process `*-*-` with a save and a resume (beside it, a `M*-*` pattern refused
at start-up: Mamba needs CUDA kernels), one process `*E` (an MoE layer of TE grouped experts) with a
save and a resume, and PP=2 `*-|*-` with a save and a resume
through the patched Megatron-LM pretrain_hybrid.py main (patches/megatron-lm-pretrain_hybrid.patch's
lines). Statistics
at TP=2 / PP=2 against one process are tests/stats/test_measure_hybrid.py's."""

import json
import subprocess
import sys

import pytest

from snip_megatron.plan import Plan
from tests.pretrain.test_runs import MODEL, PATCHED_MAIN, losses, needs_training, snip_lines, state_of
from tests.pretrain.test_te_runs import (DATA, HOPPER_SNIP, TE, WORKER, check_linears_follow_the_plan,
                                         check_runtime, check_two_pipeline_stages, replanned,
                                         run_te, te_built, te_env, te_rows)

pytestmark = pytest.mark.launches

pytest.importorskip("megatron.core.models.hybrid.hybrid_model",
                    reason="megatron-core 0.16.1 (compat lane) has MambaModel, not HybridModel (0.18+)")

HYBRID = {"PROBE_FAMILY": "hybrid"}
KEYS = ["1.linear_qkv", "1.linear_proj", "2.linear_fc1", "2.linear_fc2",
        "3.linear_qkv", "3.linear_proj", "4.linear_fc1", "4.linear_fc2"]
"""`*-*-`: attention layers 1 and 3, MLP layers 2 and 4 (a GPT layer L is hybrid layers 2L-1, 2L)."""


def probed(cwd, probe, pattern: str, *argv: str, **kw) -> str:
    return run_te(cwd, [str(WORKER), str(probe)], "--hybrid-layer-pattern", pattern, *argv, sm=90, **HYBRID, **kw)


@needs_training
def test_one_process_hybrid_measures_replans_saves_and_resumes_and_mamba_is_refused_on_cpu(tmp_path):
    mamba = tmp_path / "mamba"
    mamba.mkdir()
    with (mamba / "stderr").open("w") as err:  # runs beside the training run
        refused = subprocess.Popen([sys.executable, str(WORKER), str(mamba / "probe"), *MODEL, *TE, *DATA,
                                    "--hybrid-layer-pattern", "M*-*", "--train-iters", "2", "--snip"],
                                   cwd=mamba, env=te_env(90, **HYBRID), stdout=subprocess.DEVNULL, stderr=err)
    ckpt = tmp_path / "ckpt"
    common = [*DATA, "--save-interval", "2", "--train-iters", "6", *HOPPER_SNIP]
    out = probed(tmp_path, tmp_path / "a", "*-*-", *common, "--exit-interval", "4", "--save", str(ckpt))
    lines = snip_lines(out)
    assert ("[snip] on; backend te; formats fp8=blockwise(pow2); plan: initial fp8 "
            "{'bf16': 0, 'fp8': 8, 'fp4': 0}") in lines, lines
    assert any(line.startswith("[snip] step 3: plan") and "solver" in line for line in lines), lines
    probe = json.loads((tmp_path / "a" / "rank0.json").read_text())
    assert "HybridModel" in probe["module_types"] and "MLPLayer" in probe["module_types"]
    assert sorted(probe["planned"]) == sorted(KEYS)
    assert {v[0] for v in probe["te_built"].values()} == {"fp8"}  # the build-time recipe
    rows = te_rows(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and replanned(rows, "bf16")
    check_linears_follow_the_plan(rows)
    check_runtime(rows)
    assert sorted(losses(out)) == [1, 2, 3, 4]
    s4 = state_of(ckpt, 4)
    assert {str(k): p.value for k, p in Plan.from_dict(s4["plan"]).items()} == rows[-1]["plan"]

    out = probed(tmp_path, tmp_path / "b", "*-*-", *common, "--save", str(ckpt), "--load", str(ckpt))
    lines = snip_lines(out)
    assert any(line.endswith(f"plan: checkpoint {Plan.from_dict(s4['plan']).counts()}") for line in lines), lines
    probe = json.loads((tmp_path / "b" / "rank0.json").read_text())
    assert {k: v[0] for k, v in probe["te_built"].items()} == rows[-1]["plan"]  # built with the resumed plan
    resumed = te_rows(tmp_path / "b")
    assert [r["step"] for r in resumed] == [5, 6] and resumed[0]["plan"] == rows[-1]["plan"]
    check_linears_follow_the_plan(resumed)
    check_runtime(resumed)
    assert any(line.startswith("[snip] step 6: plan") for line in lines)  # measured at 5

    assert refused.wait(timeout=300) == 2
    stderr = (mamba / "stderr").read_text()
    assert ("--hybrid-layer-pattern 'M*-*': Mamba (M) layers run CUDA kernels (mamba_ssm, causal_conv1d; fla), "
            "so on CPU SNIP cannot measure their in_proj/out_proj linears") in stderr, stderr
    assert not (mamba / "probe" / "rank0.json").exists()  # refused before Megatron built anything


@needs_training
def test_one_process_hybrid_moe_layer_with_grouped_experts_measures_replans_and_resumes(tmp_path):
    """`*E`: an attention layer, then an MoE layer (4 experts, top-2, TEGroupedMLP over the TE
    double's GroupedLinear, SNIP's split padding, and shared experts): its grouped expert_fc1/fc2
    are planned units (the GPT adapter's), its shared experts planned linears, the router never
    planned; measured, re-planned at step 1 (an expert unit to
    BF16), saved, and resumed with the checkpoint's plan."""
    from tests.pretrain.test_moe_runs import replans

    ckpt = tmp_path / "ckpt"
    common = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-grouped-gemm",
              "--moe-shared-expert-intermediate-size", "32", "--moe-aux-loss-coeff", "1e-2",
              *DATA, "--snip", "--snip-warmup", "1", "--snip-interval", "2",
              "--snip-lag", "0", "--snip-fp8-budget", "0.5", "--save-interval", "2", "--save", str(ckpt),
              "--train-iters", "3"]
    out = probed(tmp_path, tmp_path / "p", "*E", *common, "--exit-interval", "2")
    lines = snip_lines(out)
    assert any(line.startswith("[snip] MoE: 2 routed-expert units planned") and "decoder.layers.*.mlp.router" in line
               for line in lines), lines
    assert "[snip] rank 0 runs the plan on its 6 planned linears: {'bf16': 0, 'fp8': 6, 'fp4': 0}" in lines, lines
    assert len(replans(out)) == 1 and sorted(losses(out)) == [1, 2]
    probe = json.loads((tmp_path / "p" / "rank0.json").read_text())
    assert "MoETransformerLayer" in probe["module_types"] and "TEGroupedMLP" in probe["module_types"]
    assert sorted(probe["planned"]) == ["1.linear_proj", "1.linear_qkv", "2.expert_fc1", "2.expert_fc2",
                                        "2.shared_expert_fc1", "2.shared_expert_fc2"]
    rows = te_rows(tmp_path / "p")
    assert [r["step"] for r in rows] == [1, 2]
    check_linears_follow_the_plan(rows)
    check_runtime(rows)
    assert any(rows[0]["plan"][k] == "bf16" for k in ("2.expert_fc1", "2.expert_fc2")), rows[0]["plan"]
    plan = Plan.from_dict(state_of(ckpt, 2)["plan"])
    assert {str(k): p.value for k, p in plan.items()} == rows[-1]["plan"]

    out = probed(tmp_path, tmp_path / "q", "*E", *common, "--load", str(ckpt))
    assert any(line.endswith(f"plan: checkpoint {plan.counts()}") for line in snip_lines(out)), snip_lines(out)
    assert sorted(losses(out)) == [3]
    resumed = te_rows(tmp_path / "q")
    assert resumed[0]["plan"] == {str(k): p.value for k, p in plan.items()}
    check_linears_follow_the_plan(resumed)
    check_runtime(resumed)


# The main block of Megatron-LM's pretrain_hybrid.py (core_v0.19.0) with the patch's SNIP lines, on
# CPU: the GPT main's, with pretrain_hybrid.py's config and the hybrid patch's import, and the probe
# (SNIP reads the GPU generation from the TE double, see pretrain_worker.py).
PATCHED_HYBRID_MAIN = PATCHED_MAIN.replace(
    "from snip_megatron.megatron.pretrain_gpt import setup_megatron_lm",
    "from snip_megatron.pretrain.setup import setup_megatron_lm").replace(
    "gpt_config_from_args", "hybrid_config_from_args").replace(
    'if __name__ == "__main__":\n',
    'if __name__ == "__main__":\n    from pathlib import Path\n'
    '    from tests.pretrain.pretrain_worker import install_probe, use_the_doubles_gpu\n'
    '    use_the_doubles_gpu()\n    install_probe(Path(PROBE))\n', 1)


@needs_training
def test_patched_pretrain_hybrid_at_pp2_plans_each_segment_by_its_hybrid_layers_and_resumes(tmp_path):
    """`*-|*-` over two pipeline stages: stage 1 holds hybrid layers 3 and 4 (Megatron's
    select_pipeline_segment offset), each stage's TE linears run their own layers' precisions, the
    per-stage budgets follow the segments, the saved plan is keyed by hybrid layer, and the resumed
    run builds each stage's linears with that plan at its offset."""
    def patched_main(probe: str) -> list:
        script = tmp_path / f"pretrain_hybrid_{probe}.py"
        script.write_text(PATCHED_HYBRID_MAIN.replace("PROBE", repr(str(tmp_path / probe))))
        return [str(script)]

    common = ["--hybrid-layer-pattern", "*-|*-", "--pipeline-model-parallel-size", "2", *DATA, "--train-iters", "6",
              "--save", str(tmp_path / "ckpt"), "--save-interval", "4", *HOPPER_SNIP]
    out = run_te(tmp_path, patched_main("p"), *common, "--exit-interval", "4", sm=90, nproc=2)
    lines = snip_lines(out)
    assert any(line.startswith("[snip] step 3: plan") for line in lines), lines
    assert "[snip] rank 0 runs the plan on its 4 planned linears: {'bf16': 0, 'fp8': 4, 'fp4': 0}" in lines
    stages = json.loads((tmp_path / "p" / "rank0.json").read_text())["stages"]
    assert stages == {k: 0 if int(k.split(".")[0]) <= 2 else 1 for k in KEYS}
    assert check_two_pipeline_stages(tmp_path / "p") == {0: sorted(KEYS[:4]), 1: sorted(KEYS[4:])}
    saved = Plan.from_dict(state_of(tmp_path / "ckpt", 4)["plan"])
    plan = {str(k): p.value for k, p in saved.items()}
    assert sorted(plan) == sorted(KEYS) and plan == te_rows(tmp_path / "p", 0)[-1]["plan"]

    out = run_te(tmp_path, patched_main("q"), *common, "--load", str(tmp_path / "ckpt"), sm=90, nproc=2)
    assert any(line.endswith(f"plan: checkpoint {saved.counts()}") for line in snip_lines(out))
    for rank, keys in ((0, KEYS[:4]), (1, KEYS[4:])):
        assert te_built(tmp_path / "q", rank) == {k: plan[k] for k in keys}  # at the stage's offset
        rows = te_rows(tmp_path / "q", rank)
        assert [r["step"] for r in rows] == [5, 6]
        check_linears_follow_the_plan(rows)
        check_runtime(rows)
