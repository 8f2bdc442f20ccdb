"""Megatron-LM's loop with `--transformer-impl transformer_engine --snip` on CPU, over the TE test
double (prod lane: megatron.training ships with megatron-core >= 0.19). Megatron builds its TE
layer spec (TELayerNormColumnParallelLinear / TERowParallelLinear); SNIP measures, re-plans and
delivers each plan to every TE linear through `finish_init` (its `te_quant_params`), and the
double records what each linear then ran. The double stands in for an H100 (SM90: FP4 through
TE's reference-quantizer custom recipe) or a B200 (SM100: NVFP4 kernels); SNIP reads that
generation from the double (tests/pretrain/pretrain_worker.py). Subprocesses only: this process
keeps TE absent. Runs: one process with a save and a resume (the resumed model built without a
recipe gets the plan at step 1), TP=2, PP=2 with virtual pipelining, the patched Megatron-LM main."""

import json
import os
import subprocess
import sys
from pathlib import Path

from snip_megatron.plan import Plan
from tests.distributed import ROOT, run_distributed
from tests.pretrain.test_runs import MODEL, PATCHED_MAIN, losses, needs_training, snip_lines, state_of

DOUBLE = ROOT / "tests" / "te_double"
WORKER = ROOT / "tests" / "pretrain" / "pretrain_worker.py"
TE = ["--transformer-impl", "transformer_engine"]
# What the double runs for each planned precision, per GPU generation: our recipe name, and
# whether FP4 gradients are rounded stochastically (TE's kernels) or to nearest (its reference).
LABELS = {"bf16": "high_precision", "fp8": "blockwise", "fp4": "nvfp4"}
STOCHASTIC_FP4 = {90: False, 100: True}


def te_env(sm: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "TE_DOUBLE_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(DOUBLE)]), PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1", TE_DOUBLE_COMPUTE_CAPABILITY=f"{sm // 10}.{sm % 10}", **extra)
    return env


def run_te(cwd: Path, target: list, *argv: str, sm: int, nproc: int = 1, timeout: float = 600,
           **extra_env) -> str:
    args = [*target, *MODEL, *TE, *argv]
    if nproc > 1:
        return run_distributed(args, nproc=nproc, timeout=timeout, env=te_env(sm, **extra_env)).stdout
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=te_env(sm, **extra_env), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc.stdout


def probed(cwd: Path, probe: Path, *argv: str, **kw) -> str:
    return run_te(cwd, [str(WORKER), str(probe)], *argv, **kw)


def te_rows(probe: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (probe / f"rank{rank}_te.jsonl").read_text().splitlines()]


def check_linears_follow_the_plan(rows: list[dict], sm: int) -> None:
    """After every step, each TE linear of this rank was told its planned precision and ran it, in
    the formats TE runs on SM`sm`."""
    for row in rows:
        assert row["linears"], row
        for key, (precision, label, spec) in row["linears"].items():
            assert precision == row["plan"][key], (row["step"], key, precision, row["plan"][key])
            assert label == LABELS[precision], (row["step"], key, label)
            if precision == "fp8":
                assert "pow2" in spec, spec  # TE's power-of-two blockwise scales (its default)
            if precision == "fp4":
                assert (" sr" in spec) == STOCHASTIC_FP4[sm], (sm, spec)


def replanned(rows: list[dict]) -> bool:
    """Some step ran FP4 linears after steps that ran none (the initial plan is all FP8)."""
    ran_fp4 = [any(v[0] == "fp4" for v in row["linears"].values()) for row in rows]
    return not ran_fp4[0] and any(ran_fp4)


SNIP = ["--snip", "--snip-warmup", "2", "--snip-interval", "3", "--snip-lag", "1", "--snip-fp4-budget", "0.5"]


@needs_training
def test_hopper_one_process_measures_replans_saves_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--mock-data", "--vocab-size", "256", "--eval-interval", "100", "--save-interval", "2",
              "--train-iters", "6", *SNIP]
    out = probed(tmp_path, tmp_path / "a", *common, "--exit-interval", "4", "--save", str(ckpt), sm=90)
    lines = snip_lines(out)
    assert ("[snip] on; backend te; formats fp8=blockwise(pow2) fp4=nvfp4(nearest); plan: initial fp8 "
            "{'bf16': 0, 'fp8': 8, 'fp4': 0}") in lines
    assert ("[snip] SM90 (Hopper): FP8 blockwise (e4m3, pow2 scales) on TE kernels; FP4 nvfp4 (nearest "
            "gradient rounding) through TE's Python reference quantizer (accuracy only, no speed-up); plan "
            "budget >= 50% of linear FLOPs in FP4, from fp8,fp4 (GEMM cost bf16=1,fp8=0.5,fp4=1)") in lines
    update = next(line for line in lines if line.startswith("[snip] step 3: plan"))
    assert "modelled GEMM speed-up 1." in update  # FP4 through the reference quantizer: no faster
    probe = json.loads((tmp_path / "a" / "rank0.json").read_text())
    assert set(probe["planned"].values()) == {"TELayerNormColumnParallelLinear", "TERowParallelLinear"}
    assert {v[0] for v in probe["te_built"].values()} == {"fp8"}  # the build-time recipe
    rows = te_rows(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and replanned(rows)
    check_linears_follow_the_plan(rows, 90)
    assert sorted(losses(out)) == [1, 2, 3, 4]
    s4 = state_of(ckpt, 4)
    assert {str(k): p.value for k, p in Plan.from_dict(s4["plan"]).items()} == rows[-1]["plan"]
    assert s4["snip_config"]["fp8_block_scales"] == "pow2" and s4["snip_config"]["fp4_gradient_rounding"] == "nearest"

    # Resume; the model is built without any recipe this time: the plan reaches it at step 1.
    out = probed(tmp_path, tmp_path / "b", *common, "--save", str(ckpt), "--load", str(ckpt), sm=90,
                 PROBE_BUILD_WITHOUT_RECIPE="1")
    probe = json.loads((tmp_path / "b" / "rank0.json").read_text())
    assert {v[0] for v in probe["te_built"].values()} == {"None"}  # no te_quant_params at build
    assert {k: v[0] for k, v in probe["te_started"].items()} == rows[-1]["plan"]
    assert any(line.endswith(f"plan: checkpoint {Plan.from_dict(s4['plan']).counts()}") for line in snip_lines(out))
    resumed = te_rows(tmp_path / "b")
    assert [r["step"] for r in resumed] == [5, 6] and resumed[0]["plan"] == rows[-1]["plan"]
    check_linears_follow_the_plan(resumed, 90)
    assert any(line.startswith("[snip] step 6: plan") for line in snip_lines(out))  # measured at 5


@needs_training
def test_blackwell_tp2_measures_and_replans_every_te_linear(tmp_path):
    out = probed(tmp_path, tmp_path / "p", "--tensor-model-parallel-size", "2", "--mock-data", "--vocab-size",
                 "256", "--eval-interval", "100", "--train-iters", "4", *SNIP, sm=100, nproc=2)
    lines = snip_lines(out)
    assert any(line.startswith("[snip] SM100 (Blackwell): FP8 blockwise (e4m3, pow2 scales) on TE kernels via "
                               "MXFP8 GEMMs; FP4 nvfp4 (stochastic gradient rounding) on TE's NVFP4 kernels")
               for line in lines), lines
    for rank in (0, 1):
        rows = te_rows(tmp_path / "p", rank)
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and replanned(rows)
        check_linears_follow_the_plan(rows, 100)
        assert len(rows[-1]["linears"]) == 8  # TP shards every planned linear
    assert te_rows(tmp_path / "p", 0)[-1]["plan"] == te_rows(tmp_path / "p", 1)[-1]["plan"]


@needs_training
def test_hopper_pp2_with_virtual_pipelining_replans_both_chunks(tmp_path):
    out = probed(tmp_path, tmp_path / "p", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                 "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8", "--mock-data",
                 "--vocab-size", "256", "--eval-interval", "100", "--train-iters", "4", *SNIP, sm=90, nproc=2)
    assert any(line.startswith("[snip] step 3: plan") for line in snip_lines(out))
    held = {}
    for rank in (0, 1):
        rows = te_rows(tmp_path / "p", rank)
        assert replanned(rows)
        check_linears_follow_the_plan(rows, 90)
        held[rank] = sorted({int(k.split(".")[0]) for k in rows[-1]["linears"]})
    assert held == {0: [1, 3], 1: [2, 4]}  # Megatron's interleaved chunks, keyed by global layer


@needs_training
def test_patched_megatron_lm_main_plans_bf16_vs_fp8_for_speed_on_hopper(tmp_path):
    """The H100 user's question through the patched main: which layers may run FP8 (no FP4), under
    the modelled GEMM speed-up of this GPU."""
    script = tmp_path / "pretrain_gpt.py"
    # CPU test only: SNIP reads the GPU generation from the TE double (see pretrain_worker.py).
    script.write_text(PATCHED_MAIN.replace(
        'if __name__ == "__main__":\n',
        'if __name__ == "__main__":\n    from tests.pretrain.pretrain_worker import use_the_doubles_gpu\n'
        '    use_the_doubles_gpu()\n', 1))
    out = run_te(tmp_path, [str(script)], "--mock-data", "--vocab-size", "256", "--train-iters", "4",
                 "--eval-interval", "100", "--save", str(tmp_path / "ckpt"), "--save-interval", "4",
                 "--snip", "--snip-warmup", "2", "--snip-interval", "10", "--snip-lag", "1",
                 "--snip-precisions", "bf16,fp8", "--snip-budget", "speedup", "--snip-speedup", "1.6",
                 "--snip-initial-precision", "bf16", sm=90)
    lines = snip_lines(out)
    assert any(line.startswith("[snip] on; backend te; formats fp8=blockwise(pow2) fp4=nvfp4; plan: initial bf16")
               for line in lines), lines
    assert ("[snip] SM90 (Hopper): FP8 blockwise (e4m3, pow2 scales) on TE kernels; plan budget modelled "
            "linear-GEMM speed-up >= 1.6x over BF16, from bf16,fp8 (GEMM cost bf16=1,fp8=0.5,fp4=1)") in lines
    update = next(line for line in lines if line.startswith("[snip] step 3: plan"))
    assert "solver" in update and float(update.split("speed-up ")[1].split("x")[0]) >= 1.6, update
    counts = Plan.from_dict(state_of(tmp_path / "ckpt", 4)["plan"]).counts()
    assert counts["fp4"] == 0 and counts["fp8"] >= 6 and counts["bf16"] >= 1, counts


@needs_training
def test_what_the_gpu_cannot_run_is_refused_at_start(tmp_path):
    """Refused before Megatron builds anything (exit status 2), with the flag and the fix (every
    refusal: tests/pretrain/test_setup.py)."""
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "p"), *MODEL, *TE, "--mock-data",
                           "--vocab-size", "256", "--train-iters", "2", "--snip", "--snip-fp4-recipe", "mxfp4"],
                          cwd=tmp_path, env=te_env(90), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cannot take SNIP as configured" in proc.stderr, proc.stderr[-3000:]
    assert "--snip-fp4-recipe='mxfp4': fp4_recipe='mxfp4' has no Transformer Engine recipe" in proc.stderr
    assert not (tmp_path / "p" / "rank0.json").exists()  # nothing was built
