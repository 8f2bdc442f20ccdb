"""Megatron-LM's loop with `--transformer-impl transformer_engine --snip` on CPU, over the TE test
double, with Megatron-LM's GPU defaults (prod lane: megatron.training ships with megatron-core >=
0.19). Megatron builds its TE layer spec (TELayerNormColumnParallelLinear / TERowParallelLinear);
SNIP measures, re-plans and delivers each plan to every TE linear through `finish_init` (its
`te_quant_params`), and the double records what each linear then ran and its run-time state.

Every run puts the apex double (tests/apex_double) on PYTHONPATH, so gradient-accumulation fusion
stays on (Megatron-LM's default; snip_megatron/pretrain/cpu.py turns it off only without apex's
wgrad kernel): Megatron builds every TE linear with `fuse_wgrad_accumulation=True` and its DDP
gives each weight a `main_grad` that TE's wgrad GEMM accumulates into. After every step the probe
(tests/pretrain/pretrain_worker.py `te_runtime`) records, per planned TE linear, that its weight
moved, that its main_grad holds a nonzero gradient and that the step's quantized forward read the
step's weights (TE's cached weight workspace refreshed at the step's first micro-batch, or no
cache at all); `check_runtime` asserts them every step, per layer.

The double stands in for an H100 (SM90: BF16/FP8 plans on TE's FP8 kernels, `--snip` alone under
an FP8 share of the linear FLOPs) or a B200 (SM100: FP8/FP4 plans on TE's NVFP4 kernels); SNIP reads
that generation from the double (pretrain_worker.py). Subprocesses only: this process keeps TE
absent (TP=2+SP x PP=2 x VPP=2 on each generation: tests/pretrain/test_layouts.py's chains). Runs: one process with a save and a resume (the resumed model built without a recipe gets
the plan at step 1 and its TE weight cache turned off), the patched Megatron-LM main, TE 2.16, a linear TE cannot quantize for its shape; start-up refusals
(each a process that exits at start-up, run beside a training run or each other to keep the file
short on two cores).

Issue 31's failures covered here: 1 (FP4 weight gradients dropped under fused wgrad accumulation
on Hopper), 2 (stale cached weights: checked every step of every run; the resumed run is the
model without a quant_recipe whose cache SNIP turns off), 3 (Hopper FP4 under pipeline warm-up),
5 (TE 2.16 on Hopper), 6 (shapes TE refuses), 7 (blockwise FP8 on CUDA < 12.9)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from snip_megatron.plan import Plan
from tests.distributed import ROOT, run_distributed, run_python
from tests.forked import MEGATRON_LM
from tests.pretrain.test_runs import MODEL, PATCHED_MAIN, losses, needs_training, snip_lines, state_of
from tests.te.te_versions import double_pythonpath, te_version_folder

pytestmark = pytest.mark.launches

WORKER = ROOT / "tests" / "pretrain" / "pretrain_worker.py"
TE = ["--transformer-impl", "transformer_engine"]
# What the double runs for each planned precision: our recipe name.
LABELS = {"bf16": "high_precision", "fp8": "blockwise", "fp4": "nvfp4"}
DATA = ["--mock-data", "--vocab-size", "256", "--eval-interval", "100"]
# Measure at step 2, plan at step 3. Hopper: at least half the linear FLOPs in FP8, so the plan
# moves linears to BF16; Blackwell: at least half in FP4.
SCHEDULE = ["--snip", "--snip-warmup", "2", "--snip-interval", "3", "--snip-lag", "1"]
HOPPER_SNIP = [*SCHEDULE, "--snip-fp8-budget", "0.5"]
BLACKWELL_SNIP = [*SCHEDULE, "--snip-fp4-budget", "0.5"]
HOPPER_LINE = ("[snip] SM90 (Hopper): FP8 blockwise (e4m3, pow2 scales) on TE kernels; plan budget >= 50% of "
               "linear FLOPs in FP8, from bf16,fp8 (GEMM cost bf16=1,fp8=0.5)")


def te_env(sm: int, *, te_version=None, **extra) -> dict:
    """A process over the TE and apex doubles standing in for SM`sm` (and TE `te_version`, a folder
    from te_version_folder), with only `extra` of the doubles' settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "TE_DOUBLE_"))}
    env.update(PYTHONPATH=double_pythonpath(te_version=te_version, apex=True), PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1", TE_DOUBLE_COMPUTE_CAPABILITY=f"{sm // 10}.{sm % 10}", **extra)
    return env


def run_te(cwd: Path, target: list, *argv: str, sm: int, nproc: int = 1, timeout: float = 600,
           te_version=None, model: "list | None" = None, **extra_env) -> str:
    """`model`: the model's flags (default test_runs.MODEL)."""
    args = [*target, *(MODEL if model is None else model), *TE, *argv]
    env = te_env(sm, te_version=te_version, **extra_env)
    if nproc > 1:
        return run_distributed(args, nproc=nproc, timeout=timeout, env=env, preload=MEGATRON_LM).stdout
    return run_python(args, cwd=cwd, env=env, timeout=timeout, preload=MEGATRON_LM).stdout


def probed(cwd: Path, probe: Path, *argv: str, **kw) -> str:
    return run_te(cwd, [str(WORKER), str(probe)], *argv, **kw)


@pytest.fixture
def refusals(tmp_path):
    """start(name, *argv, sm=..., te_version=None, **env): start snip-pretrain-gpt (through the probe
    worker) on a setting start-up must refuse, in the background; `refused(started)` waits for it,
    checks it exited with status 2 before Megatron built anything, and returns its stderr. Those
    still running at the end are stopped."""
    started = []

    def start(name: str, *argv: str, sm: int, te_version=None, **extra_env):
        folder = tmp_path / name
        folder.mkdir()
        with (folder / "stdout").open("w") as out, (folder / "stderr").open("w") as err:
            proc = subprocess.Popen([sys.executable, str(WORKER), str(folder / "probe"), *MODEL, *TE, *DATA,
                                     "--train-iters", "2", *argv], cwd=folder,
                                    env=te_env(sm, te_version=te_version, **extra_env), stdout=out, stderr=err)
        started.append(proc)
        return proc, folder

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def refused(started, timeout: float = 300) -> str:
    proc, folder = started
    proc.wait(timeout=timeout)
    stderr = (folder / "stderr").read_text()
    assert proc.returncode == 2, f"--- stdout\n{(folder / 'stdout').read_text()[-3000:]}\n--- stderr\n{stderr[-3000:]}"
    assert not (folder / "probe" / "rank0.json").exists(), folder  # nothing was built
    return stderr


def te_rows(probe: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (probe / f"rank{rank}_te.jsonl").read_text().splitlines()]


def te_built(probe: Path, rank: int) -> dict[str, str]:
    """The precision each planned TE linear of `rank` was built with (the worker's probe)."""
    built = json.loads((probe / f"rank{rank}.json").read_text())["te_built"]
    return {k: v[0] for k, v in built.items()}


def check_linears_follow_the_plan(rows: list[dict], *, fp8: str = "blockwise", fp4_rounding: str = "sr") -> None:
    """After every step, each TE linear of this rank was told its planned precision and ran it:
    FP8 in `fp8` (blockwise with TE's power-of-two scales, its default; or tensorwise), FP4 on TE's
    NVFP4 kernels with stochastic gradient rounding."""
    for row in rows:
        assert row["linears"], row
        for key, (precision, label, spec) in row["linears"].items():
            assert precision == row["plan"][key], (row["step"], key, precision, row["plan"][key])
            assert label == {**LABELS, "fp8": fp8}[precision], (row["step"], key, label)
            if precision == "fp8" and fp8 == "blockwise":
                assert "pow2" in spec, spec
            if precision == "fp4":
                assert f" {fp4_rounding}" in spec, spec


def check_runtime(rows: list[dict], *, cache: str = "per step") -> None:
    """After every step, per planned TE linear of this rank (pretrain_worker.te_runtime):
    - TE was built with fuse_wgrad_accumulation=True (Megatron-LM's gradient-accumulation fusion);
    - its weight moved over the step, and its main_grad holds a nonzero, finite gradient at the
      step's end (Megatron zeroes the grad buffers at the start of train_step, so this is the
      step's own gradient; AdamW's decoupled weight decay moves a weight whose gradient was
      dropped, so main_grad is what shows a dropped weight gradient, per layer);
    - the step's quantized forward read the step's weights: no cache ("none": quantized at every
      micro-batch), or the cached workspace holds the weight as it was at the step's start.
    `cache`: "per step" (megatron-core >= 0.19 re-arms TE's cache for a quant_recipe: every
    quantized linear ends the step reusing the workspace its first micro-batch refreshed) or
    "off" (SNIP turned it off: every linear quantizes its weight at every micro-batch)."""
    for row in rows:
        assert row["runtime"].keys() == row["linears"].keys(), row
        for key, r in row["runtime"].items():
            where = (row["step"], key, r)
            assert r["fused"], where
            assert r["moved"], where
            assert r["main_grad"] is not None and 0 < r["main_grad"] < math.inf, where
            assert r["workspace"] == "none" or r["cache_is_step_start"] is True, where
            if cache == "off":
                assert r["cache_off"] and r["workspace"] == "none", where
            elif row["linears"][key][1] != "high_precision":
                assert not r["cache_off"] and r["workspace"] == "reused", where


def replanned(rows: list[dict], to: str) -> bool:
    """Some step ran `to` linears after steps that ran none (the initial plan is all FP8)."""
    ran = [any(v[0] == to for v in row["linears"].values()) for row in rows]
    return all(v[0] == "fp8" for v in rows[0]["linears"].values()) and not ran[0] and any(ran)


@needs_training
def test_hopper_one_process_measures_replans_saves_and_resumes(tmp_path):
    """On SM90 `--snip` plans BF16/FP8 under an FP8 share of the linear FLOPs and re-plans (BF16
    linears appear), every planned weight trains under fused wgrad accumulation (issue 31 failure
    1: before, Hopper's FP4 linears ran TE's reference custom recipe, whose GEMM drops dW under
    fusion: main_grad stayed zero while the loss fell), every step's quantized forward reads that
    step's weights; the resume builds the model without a quant_recipe, which megatron-core 0.19
    does not re-arm TE's weight cache for, so SNIP turns the cache off there (failure 2's fix) and
    the weights stay fresh."""
    ckpt = tmp_path / "ckpt"
    common = [*DATA, "--save-interval", "2", "--train-iters", "6", *HOPPER_SNIP]
    out = probed(tmp_path, tmp_path / "a", *common, "--exit-interval", "4", "--save", str(ckpt), sm=90)
    lines = snip_lines(out)
    assert ("[snip] on; backend te; formats fp8=blockwise(pow2); plan: initial fp8 "
            "{'bf16': 0, 'fp8': 8, 'fp4': 0}") in lines, lines
    assert lines[lines.index(HOPPER_LINE) + 1] == "[snip] Transformer Engine 2.14.0", lines
    update = next(line for line in lines if line.startswith("[snip] step 3: plan"))
    assert float(update.split("FP8 or lower ")[1].split("%")[0]) >= 50.0, update  # the budget
    probe = json.loads((tmp_path / "a" / "rank0.json").read_text())
    assert set(probe["planned"].values()) == {"TELayerNormColumnParallelLinear", "TERowParallelLinear"}
    assert {v[0] for v in probe["te_built"].values()} == {"fp8"}  # the build-time recipe
    rows = te_rows(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and replanned(rows, "bf16")
    assert all(v[0] != "fp4" for r in rows for v in r["linears"].values())
    check_linears_follow_the_plan(rows)
    check_runtime(rows)
    assert sorted(losses(out)) == [1, 2, 3, 4]
    s4 = state_of(ckpt, 4)
    assert {str(k): p.value for k, p in Plan.from_dict(s4["plan"]).items()} == rows[-1]["plan"]
    assert s4["snip_config"]["fp8_block_scales"] == "pow2"

    # Resume; the model is built without any recipe this time: the plan reaches it at step 1.
    out = probed(tmp_path, tmp_path / "b", *common, "--save", str(ckpt), "--load", str(ckpt), sm=90,
                 PROBE_BUILD_WITHOUT_RECIPE="1")
    lines = snip_lines(out)
    probe = json.loads((tmp_path / "b" / "rank0.json").read_text())
    assert {v[0] for v in probe["te_built"].values()} == {"None"}  # no te_quant_params at build
    assert {k: v[0] for k, v in probe["te_started"].items()} == rows[-1]["plan"]
    assert any(line.endswith(f"plan: checkpoint {Plan.from_dict(s4['plan']).counts()}") for line in lines)
    resumed = te_rows(tmp_path / "b")
    assert [r["step"] for r in resumed] == [5, 6] and resumed[0]["plan"] == rows[-1]["plan"]
    check_linears_follow_the_plan(resumed)
    check_runtime(resumed, cache="off")
    assert any(line.startswith("[snip] step 6: plan") for line in lines)  # measured at 5


def check_two_pipeline_stages(probe: Path) -> dict[int, list[str]]:
    """A PP=2 run's probe: on each stage, steps 1-4 recorded and every TE linear ran its plan with
    fresh weights; both stages' linears together re-planned to BF16 from the all-FP8 start.
    Returns {pipeline rank: its planned linears' keys}."""
    held = {}
    for rank in (0, 1):
        rows = te_rows(probe, rank)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        check_linears_follow_the_plan(rows)
        check_runtime(rows)
        held[rank] = sorted(rows[-1]["linears"])
    both = [{**a["linears"], **b["linears"]} for a, b in zip(te_rows(probe, 0), te_rows(probe, 1))]
    assert replanned([{"linears": linears} for linears in both], "bf16")
    return held


@needs_training
def test_patched_megatron_lm_main_on_cuda_12_8_plans_bf16_vs_tensorwise_fp8_for_speed(tmp_path, refusals):
    """The H100 user's question through the patched main, with the flags of earlier releases
    (`--snip-precisions bf16,fp8 --snip-budget speedup`): which layers may run FP8 under the
    modelled GEMM speed-up of this GPU. The image has CUDA 12.8 (issue 31 failure 7): TE's blockwise
    FP8 needs CUDA >= 12.9, so `--snip` with the default recipe is refused at start-up with TE's
    reason and the fix (before: start-up read the compute capability only and the run died at the
    first FP8 forward); with `--snip-fp8-recipe tensorwise` it trains."""
    blockwise = refusals("blockwise", "--snip", sm=90, TE_DOUBLE_CUDA_VERSION="12.8")
    script = tmp_path / "pretrain_gpt.py"
    # CPU test only: SNIP reads the GPU generation from the TE double, and the probe records the TE
    # linears (see pretrain_worker.py).
    script.write_text(PATCHED_MAIN.replace(
        'if __name__ == "__main__":\n',
        'if __name__ == "__main__":\n    from pathlib import Path\n'
        '    from tests.pretrain.pretrain_worker import install_probe, use_the_doubles_gpu\n'
        f'    use_the_doubles_gpu()\n    install_probe(Path({str(tmp_path / "p")!r}))\n', 1))
    out = run_te(tmp_path, [str(script)], *DATA, "--train-iters", "4",
                 "--save", str(tmp_path / "ckpt"), "--save-interval", "4",
                 "--snip", "--snip-warmup", "2", "--snip-interval", "10", "--snip-lag", "1",
                 "--snip-precisions", "bf16,fp8", "--snip-budget", "speedup", "--snip-speedup", "1.6",
                 "--snip-initial-precision", "bf16", "--snip-fp8-recipe", "tensorwise", sm=90,
                 TE_DOUBLE_CUDA_VERSION="12.8")
    lines = snip_lines(out)
    assert any(line.startswith("[snip] on; backend te; formats fp8=tensorwise; plan: initial bf16")
               for line in lines), lines
    assert ("[snip] SM90 (Hopper): FP8 tensorwise (hybrid) on TE kernels; plan budget modelled linear-GEMM "
            "speed-up >= 1.6x over BF16, from bf16,fp8 (GEMM cost bf16=1,fp8=0.5)") in lines, lines
    update = next(line for line in lines if line.startswith("[snip] step 3: plan"))
    assert "solver" in update and float(update.split("speed-up ")[1].split("x")[0]) >= 1.6, update
    counts = Plan.from_dict(state_of(tmp_path / "ckpt", 4)["plan"]).counts()
    assert counts["fp4"] == 0 and counts["fp8"] >= 6 and counts["bf16"] >= 1, counts
    rows = te_rows(tmp_path / "p")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert {v[0] for r in rows[:2] for v in r["linears"].values()} == {"bf16"}
    check_linears_follow_the_plan(rows, fp8="tensorwise")
    check_runtime(rows)  # steps 3-4 in FP8: step 4 refreshes the workspace step 3 created

    stderr = refused(blockwise)
    assert ("--snip-fp8-recipe='blockwise': Transformer Engine 2.14.0 says: FP8 block scaled GEMM requires "
            "compute capability 9.0 or higher and CUDA >= 12.9; choose --snip-fp8-recipe tensorwise") in stderr, stderr


@needs_training
def test_te_2_16_on_hopper_trains_with_snip_defaults_and_te_older_than_2_9_is_refused(tmp_path, refusals):
    """Issue 31 failure 5: before, `--snip` on SM90 planned FP4 through TE 2.14's reference-quantizer
    factory module, which TE 2.16 renamed, so a TE 2.16 run passed start-up and crashed at the first
    FP4 forward, and no TE version was checked. Now `--snip` alone there plans BF16/FP8 under at
    least 90% of the linear FLOPs in FP8, says the TE version, and trains; a TE older than 2.9 is
    refused at start-up."""
    old = refusals("te-2.8", "--snip", sm=90, te_version=te_version_folder("2.8.0", tmp_path))
    out = probed(tmp_path, tmp_path / "p", *DATA, "--train-iters", "3", *SCHEDULE, sm=90,
                 te_version=te_version_folder("2.16.0", tmp_path))
    lines = snip_lines(out)
    assert ("[snip] SM90 (Hopper): FP8 blockwise (e4m3, pow2 scales) on TE kernels; plan budget >= 90% of "
            "linear FLOPs in FP8, from bf16,fp8 (GEMM cost bf16=1,fp8=0.5)") in lines, lines
    assert "[snip] Transformer Engine 2.16.0" in lines, lines
    update = next(line for line in lines if line.startswith("[snip] step 3: plan"))
    assert "solver" in update and float(update.split("FP8 or lower ")[1].split("%")[0]) >= 90.0, update
    assert sorted(losses(out)) == [1, 2, 3]
    rows = te_rows(tmp_path / "p")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(v[0] in ("bf16", "fp8") for r in rows for v in r["linears"].values())
    check_linears_follow_the_plan(rows)
    check_runtime(rows)

    stderr = refused(old)
    assert ("Transformer Engine 2.8.0 is older than 2.9, the oldest SNIP's TE backend runs on; install "
            "transformer-engine>=2.9") in stderr, stderr


@needs_training
def test_a_linear_te_cannot_quantize_for_its_shape_is_kept_in_bf16_from_the_start(tmp_path):
    """Issue 31 failure 6: linear_fc2's input features (--ffn-hidden-size 200) are not a multiple of
    16, which TE asserts for every FP8/FP4 GEMM operand. Before, the plan put fc2 in FP8 and the
    run crashed at its first FP8 forward (TE's shape ValueError); now start-up says fc2 is kept out
    of FP8 and FP4, the other linears are measured and re-planned to FP4, and fc2 runs BF16 every
    step."""
    out = probed(tmp_path, tmp_path / "p", "--ffn-hidden-size", "200", *DATA, "--train-iters", "3",
                 *BLACKWELL_SNIP, sm=100)
    lines = snip_lines(out)
    for precision, recipe, lead in (("FP8", "blockwise", 8), ("FP4", "nvfp4", 16)):
        assert (f"[snip] linear_fc2 kept out of {precision} in every layer: TE's {recipe} needs every operand's "
                f"leading dims divisible by {lead} and last dim by 16; this rank's weight 64x200 and input "
                "64x200 are not") in lines, lines
    assert not any("kept out" in line and "linear_fc2" not in line for line in lines), lines
    assert ("[snip] on; backend te; formats fp8=blockwise(pow2) fp4=nvfp4(stochastic); plan: initial fp8 "
            "{'bf16': 2, 'fp8': 6, 'fp4': 0}") in lines, lines  # fc2 starts in BF16
    assert any(line.startswith("[snip] step 3: plan") for line in lines), lines
    assert sorted(losses(out)) == [1, 2, 3]
    rows = te_rows(tmp_path / "p")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        for key, (precision, label, _) in row["linears"].items():
            if key.endswith("linear_fc2"):
                assert (precision, label) == ("bf16", "high_precision"), (row["step"], key)
    assert any(v[0] == "fp4" for v in rows[-1]["linears"].values())  # the others re-planned
    check_linears_follow_the_plan(rows)
    check_runtime(rows)


@needs_training
def test_what_the_gpu_cannot_run_is_refused_at_start(refusals):
    """Refused before Megatron builds anything (exit status 2), with the flag and the fix (every
    refusal: tests/pretrain/test_setup.py): an FP4 recipe TE has none of, and FP4 asked for on
    Hopper with TE's linears, by budget or by precisions (issue 31 failures 1 and 3: before, it ran
    through TE's reference FP4 quantizer, which dropped weight gradients under fused wgrad
    accumulation and crashed in pipeline warm-up); the fix names SNIP's emulated linears."""
    mxfp4 = refusals("mxfp4", "--snip", "--snip-fp4-recipe", "mxfp4", sm=90)
    budget = refusals("fp4-budget", "--snip", "--snip-fp4-budget", "0.75", sm=90)
    precisions = refusals("fp4-precisions", "--snip", "--snip-precisions", "fp8,fp4", sm=90)
    stderr = refused(mxfp4)
    assert "cannot take SNIP as configured" in stderr, stderr[-3000:]
    assert "--snip-fp4-recipe='mxfp4': fp4_recipe='mxfp4' has no Transformer Engine recipe" in stderr, stderr
    for started in (budget, precisions):
        stderr = refused(started)
        assert ("TE's NVFP4 kernels need SM100+ (Blackwell), this GPU is SM90 (Hopper); before SM100 SNIP's TE "
                "backend plans BF16 and FP8") in stderr, stderr
        assert ("FP4 runs on SNIP's emulated linears (--transformer-impl local), which compute exactly what SNIP "
                "measures on any GPU") in stderr, stderr
