"""SNIP's Transformer Engine path on CPU: Megatron-Core's real TE wrappers over the TE test double.

The double (tests/te_double, TE 2.14) is importable only in the subprocesses these tests start
(Megatron caches HAVE_TE at import, so this process and the rest of the suite keep TE absent):
- double_checks.py:   the double alone (recipes and their variants, the custom-recipe qfactory
                      protocol, autocast rules, GPU checks, numerics, refusals) and TE's run-time
                      state (weight workspaces, fused wgrad accumulation, the reference NVFP4
                      tensor emptied while saved, shape / bias rules, CUDA gates, other TE
                      versions via te_versions.py, the apex double under Megatron's local linear;
                      context-parallel attention on two processes, cp_attention_worker.py);
- megatron_checks.py: one process, TP=1: import, the TE layer spec, training, the plan through
                      quant_recipe -> finish_init -> per-module autocast, bit-exact numerics, and
                      for SM90 / SM100 and every recipe flag the TE dict against the formats SNIP
                      measures (again with NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1);
- te_worker.py under torchrun: TP=2 and PP=2 training against the TP=1 losses.
Every process runs with Megatron's GPU default gradient-accumulation fusion on (TE's
fuse_wgrad_accumulation into DDP's main_grad; tests/apex_double stands in for apex's kernel).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.te.te_versions import double_pythonpath

ROOT = Path(__file__).resolve().parents[2]
DOUBLE = ROOT / "tests" / "te_double"
HERE = Path(__file__).resolve().parent
REL_TOL = 1e-5

DOUBLE_CHECKS = [
    "check_version_from_metadata",
    "check_recipe_defaults_follow_te_2_14",
    "check_autocast_nesting_and_restore",
    "check_linear_runs_our_emulation_per_recipe",
    "check_variants_run_our_formats_of_them",
    "check_custom_recipe_calls_the_factory_per_role_and_runs_the_reference_nvfp4",
    "check_unemulated_variants_are_recorded_and_refused",
    "check_gpu_capability_checks_follow_te",
    "check_unmodelled_features_are_refused",
    "check_same_family_switch_keeps_quantizers_and_class_change_warns",
    "check_layernorm_linear_norms_and_returns_norm_output",
    "check_norm_modules",
    "check_dot_product_attention_gqa_causal",
    "check_context_parallel_attention_equals_the_whole_sequence",
    "check_rng_tracker",
    "check_weight_workspace_follows_is_first_microbatch",
    "check_workspaces_cleared_on_recipe_class_change_only",
    "check_fused_wgrad_accumulates_into_main_grad",
    "check_grouped_linear_runs_each_split_as_a_linear_and_refuses_unaligned_splits",
    "check_custom_recipe_gemm_drops_wgrad_under_fusion",
    "check_reference_workspace_is_emptied_until_its_backward",
    "check_shape_and_bias_refusals",
    "check_cuda_and_cublas_gates",
    "check_version_folder_sets_version_and_custom_recipes_layout",
    "check_apex_double_runs_megatrons_fused_wgrad",
]
MEGATRON_CHECKS = [
    "check_import_sees_te_and_its_version",
    "check_layer_spec_builds_te_wrappers",
    "check_te_spec_trains_like_the_local_spec",
    "check_trains_at_tp1",
    "check_plan_reaches_te_quant_params",
    "check_te_dicts_and_measured_formats_name_the_same_numerics",
    "check_hopper_plans_bf16_fp8_and_trains_them_with_fused_wgrad",
    "check_megatron_alone_leaves_te_weights_stale_before_0_19",
    "check_step2_quantized_forward_equals_emulation_on_step2_weights",
    "check_planned_modules_compute_our_emulation",
    "check_module_recipe_nests_inside_global_autocast",
    "check_mixed_plan_trains_and_each_module_keeps_its_format",
    "check_te_rng_tracker_drives_attention_dropout",
]
# Planned precision of each "<global layer>.<linear>" and what the double must run for it
# (mirrors te_worker.PLAN_TABLE / EXPECTED_LABEL, which this process cannot import: it imports TE).
PLANNED_LABELS = {"1.linear_qkv": "blockwise", "1.linear_proj": "nvfp4",
                  "1.linear_fc1": "high_precision", "1.linear_fc2": "blockwise",
                  "2.linear_qkv": "nvfp4", "2.linear_proj": "high_precision",
                  "2.linear_fc1": "blockwise", "2.linear_fc2": "nvfp4"}
TE_CLASSES = {"layers.0.self_attention.linear_qkv": "TELayerNormColumnParallelLinear",
              "layers.0.self_attention.core_attention": "TEDotProductAttention",
              "layers.0.self_attention.linear_proj": "TERowParallelLinear",
              "layers.0.mlp.linear_fc1": "TELayerNormColumnParallelLinear",
              "layers.0.mlp.linear_fc2": "TERowParallelLinear"}


def _double_env(fp32_block_scales: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "TE_DOUBLE_"))}
    env.update(PYTHONPATH=double_pythonpath(apex=True), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    if fp32_block_scales:  # TE's switch to FP32 blockwise scales (read once, at import)
        env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] = "1"
    return env


def _run_checks(script: str, out: Path, fp32_block_scales: bool, only: "str | None" = None) -> dict:
    proc = subprocess.run([sys.executable, str(HERE / script), "--out", str(out)]
                          + ([] if only is None else ["--only", only]), cwd=ROOT,
                          env=_double_env(fp32_block_scales), capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _run_worker(tmp: Path, *args: str) -> list[dict]:
    run_distributed([str(HERE / "te_worker.py"), *args, "--out", str(tmp)], nproc=2, timeout=600,
                    env={"PYTHONPATH": double_pythonpath(apex=True)})
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def double_results(tmp_path_factory):
    return _run_checks("double_checks.py", tmp_path_factory.mktemp("te") / "double.json",
                       fp32_block_scales=False)


@pytest.fixture(scope="module")
def megatron_results(tmp_path_factory):
    return _run_checks("megatron_checks.py", tmp_path_factory.mktemp("te") / "megatron.json",
                       fp32_block_scales=False)


@pytest.fixture(scope="module")
def fp32_scales_results(tmp_path_factory):
    return _run_checks("megatron_checks.py", tmp_path_factory.mktemp("te") / "fp32.json",
                       fp32_block_scales=True, only=SAME_NUMERICS)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return _run_worker(tmp_path_factory.mktemp("tp2"), "--tp", "2",
                       "--variants", "megatron_init,plan,sp_pair")


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return _run_worker(tmp_path_factory.mktemp("pp2"), "--pp", "2", "--variants", "name_init,plan")


def _close(got: list, want: list) -> bool:
    return len(got) == len(want) > 0 and all(abs(a - b) <= REL_TOL * abs(b) for a, b in zip(got, want))


def test_double_is_absent_from_this_process():
    assert str(DOUBLE) not in sys.path
    assert importlib.util.find_spec("transformer_engine") is None
    from megatron.core.extensions.transformer_engine import HAVE_TE

    assert HAVE_TE is False


def test_te_version_folder_holds_only_the_version_metadata(tmp_path):
    """te_versions.py (used by double_checks' version check, and by tests that need another TE
    version): one dist-info, placed before tests/te_double on the path it builds."""
    from email.parser import Parser

    from tests.te.te_versions import double_pythonpath, te_version_folder

    folder = te_version_folder("2.16.0", tmp_path)
    assert [p.name for p in folder.iterdir()] == ["transformer_engine-2.16.0.dist-info"]
    meta = Parser().parsestr((folder / "transformer_engine-2.16.0.dist-info" / "METADATA").read_text())
    assert (meta["Name"], meta["Version"]) == ("transformer-engine", "2.16.0")
    parts = double_pythonpath(te_version=folder, apex=True).split(os.pathsep)
    assert parts == [str(ROOT), str(folder), str(ROOT / "tests" / "apex_double"), str(DOUBLE)]


@pytest.mark.launches
@pytest.mark.parametrize("name", DOUBLE_CHECKS)
def test_double_alone(double_results, name):
    assert double_results.get(name) == "ok", double_results.get(name, "check did not run")


@pytest.mark.launches
@pytest.mark.compat
@pytest.mark.parametrize("name", MEGATRON_CHECKS)
def test_megatron_te_wrappers(megatron_results, name):
    assert megatron_results.get(name) == "ok", megatron_results.get(name, "check did not run")


SAME_NUMERICS = "check_te_dicts_and_measured_formats_name_the_same_numerics"
FLAG_NAMES = ["defaults", "fp8_format=hybrid", "fp8_recipe=tensorwise", "fp8_recipe=tensorwise,fp8_format=e4m3",
              "fp8_recipe=mxfp8", "fp8_block_scales=pow2", "fp8_block_scales=fp32",
              "fp4_gradient_rounding=nearest", "fp4_gradient_rounding=stochastic", "fp4_recipe=mxfp4"]


def _refused(report: dict, sm: int) -> set:
    names = {k.split(" ", 1)[1] for k in report if k.startswith(f"SM{sm} ")}
    assert names == set(FLAG_NAMES), names  # every flag was tried on every generation
    return {k.split(" ", 1)[1] for k, v in report.items() if k.startswith(f"SM{sm} ") and v.startswith("refused")}


@pytest.mark.launches
def test_te_dicts_and_measured_formats_agree_and_refusals_are_the_ones_te_needs(megatron_results,
                                                                              fp32_scales_results):
    """TE's default environment, then NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1: what each generation
    refuses at start-up (the rest ran the very FormatSpec SNIP measures, asserted in the check)."""
    default = megatron_results[f"{SAME_NUMERICS}.data"]
    fp4_flags = {"fp4_gradient_rounding=nearest", "fp4_gradient_rounding=stochastic", "fp4_recipe=mxfp4"}
    # SM90 plans BF16/FP8 with TE: any FP4 setting is refused there, with the fix.
    assert _refused(default, 90) == {"fp8_recipe=mxfp8", "fp8_block_scales=fp32"} | fp4_flags
    assert _refused(default, 100) == {"fp8_block_scales=fp32", "fp4_gradient_rounding=nearest", "fp4_recipe=mxfp4"}
    assert default["SM90 defaults"] == "fp8=blockwise(pow2) fp4=nvfp4"  # FP4 is never planned there
    assert default["SM100 defaults"] == "fp8=blockwise(pow2) fp4=nvfp4(stochastic)"
    assert fp32_scales_results[SAME_NUMERICS] == "ok", fp32_scales_results[SAME_NUMERICS]
    fp32 = fp32_scales_results[f"{SAME_NUMERICS}.data"]
    assert _refused(fp32, 90) == {"fp8_recipe=mxfp8", "fp8_block_scales=pow2"} | fp4_flags
    assert fp32["SM90 defaults"] == "fp8=blockwise fp4=nvfp4"
    # Blackwell runs blockwise FP8 through MXFP8, which needs power-of-two scales: every blockwise
    # run is refused there, and the double's kernel check shows why.
    blockwise = {n for n in FLAG_NAMES if "tensorwise" not in n and "mxfp8" not in n}
    assert _refused(fp32, 100) == blockwise
    assert "requires using power of two scaling factors" in fp32["SM100 defaults"]


@pytest.mark.launches
def test_every_check_is_listed(double_results, megatron_results):
    assert [k for k in double_results if not k.endswith(".data")] == DOUBLE_CHECKS
    assert [k for k in megatron_results if not k.endswith(".data")] == MEGATRON_CHECKS


@pytest.mark.launches
def test_tp2_trains_like_tp1(tp2, megatron_results):
    tp1 = megatron_results["check_trains_at_tp1.data"]["megatron_init"]
    for rank in tp2:
        run = rank["megatron_init"]
        assert _close(run["losses"], tp1), (run["losses"], tp1)
        assert {k: run["classes"][k] for k in TE_CLASSES} == TE_CLASSES


def _every_step_moved_every_weight_from_its_own(run: dict) -> None:
    """Megatron's fused wgrad (TE's fuse_wgrad_accumulation into DDP's main_grad): at every step every
    planned weight of this rank moved, its main_grad was nonzero, each quantized forward read that
    step's weight (TE's cache refreshed per step, or off)."""
    assert run["steps"], run
    for i, step in enumerate(run["steps"]):
        assert step["unmoved"] == [] and step["zero_main_grad"] == [] and step["stale"] == [], (i, step)


@pytest.mark.launches
def test_tp2_plan_runs_each_planned_format(tp2):
    for rank in tp2:
        run = rank["plan"]
        assert run["losses"][-1] < 0.85 * run["losses"][0], run["losses"]
        assert {k: list(v) for k, v in run["runs"].items()} == {k: [v] for k, v in PLANNED_LABELS.items()}
        _every_step_moved_every_weight_from_its_own(run)
        _every_step_moved_every_weight_from_its_own(rank["megatron_init"])


@pytest.mark.launches
def test_tp2_sequence_parallel_collectives(tp2):
    for rank in tp2:
        diffs = rank["sp_pair"]
        assert set(diffs) == {"y", "dx", "ln_out", "dw_col", "dw_row", "dgamma"}
        assert all(d < REL_TOL for d in diffs.values()), diffs


@pytest.mark.launches
def test_pp2_trains_like_tp1(pp2, megatron_results):
    tp1 = megatron_results["check_trains_at_tp1.data"]["name_init"]
    first, last = pp2
    assert first["name_init"]["losses"] == [] and _close(last["name_init"]["losses"], tp1)
    assert {k: first["name_init"]["classes"][k] for k in TE_CLASSES} == TE_CLASSES


@pytest.mark.launches
def test_pp2_plan_reaches_each_stage_by_global_layer(pp2):
    first, last = pp2
    assert {k: list(v) for k, v in first["plan"]["runs"].items()} == \
        {k: [v] for k, v in PLANNED_LABELS.items() if k.startswith("1.")}
    assert {k: list(v) for k, v in last["plan"]["runs"].items()} == \
        {k: [v] for k, v in PLANNED_LABELS.items() if k.startswith("2.")}
    losses = last["plan"]["losses"]
    assert losses[-1] < 0.85 * losses[0], losses
    for rank in pp2:
        _every_step_moved_every_weight_from_its_own(rank["plan"])
