"""bench/gpu/hybrid_check.py on CPU: its Mamba/GDN run needs a GPU, Transformer Engine and the
layers' CUDA kernels, so these tests cover its argument handling, its refusals and its verdict."""

import importlib.util
import subprocess
import sys

import pytest

from tests.distributed import ROOT

SCRIPT = ROOT / "bench" / "gpu" / "hybrid_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("bench_hybrid_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.launches
def test_the_script_refuses_without_a_gpu():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--pattern", "M*M-"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "needs a CUDA GPU, Transformer Engine and the Mamba/GDN kernels; this machine has no GPU" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--pattern", "*E*E"], "has MoE (E) layers"), (["--pattern", "+-+-"], "multi-latent attention layers (+)"),
    (["--pattern", "*-*-"], "has no Mamba (M) or GDN (G) layer"),
    (["--steps", "3"], "--steps must be at least 4"),
])
def test_arguments_it_cannot_run_are_refused_by_argparse(check, capsys, argv, message):
    with pytest.raises(SystemExit) as bad:
        check.parse_args(argv)
    assert bad.value.code == 2 and message in capsys.readouterr().err


def test_kernels_keys_and_refusals_of_a_pattern(check):
    args = check.parse_args([])
    assert args.pattern == "*M*-" and args.steps == 6
    assert check.needed_kernels("*M*-G|M-") == ["mamba_ssm", "causal_conv1d", "fla"]
    assert check.cuda_linears("*M*-G|M-") == ["2.in_proj", "2.out_proj", "5.in_proj", "5.out_proj",
                                              "6.in_proj", "6.out_proj"]
    assert check.pattern_keys("*M") == ["1.linear_qkv", "1.linear_proj", "2.in_proj", "2.out_proj"]
    assert check.refusal(True, None, []) is None
    assert "no GPU" in check.refusal(False, None, [])
    assert "needs Transformer Engine (absent)" in check.refusal(True, "absent", [])
    assert "need fla, not importable" in check.refusal(True, None, ["fla"])


def test_the_verdict_needs_every_linear_trained_and_a_replan(check):
    te_check = importlib.util.module_from_spec(spec := importlib.util.spec_from_file_location(
        "bench_te_check", ROOT / "bench" / "gpu" / "te_check.py"))
    sys.modules["bench_te_check"] = te_check
    try:
        spec.loader.exec_module(te_check)
    finally:
        sys.modules.pop("bench_te_check", None)
    good = {"precision": "fp8", "moved": True, "main_grad": True, "fused": True}
    keys = check.pattern_keys("*M")
    records = [{"step": s, "fusion": True, "precisions": ["bf16", "fp8"], "linears": {k: good for k in keys}}
               for s in (1, 2, 3, 4)]
    replan = ["[snip] step 3: plan abc FP8 or lower 50.0%"]
    verdict = check.judge("*M", records, replan, 0, te_check.evaluate_probe)
    assert verdict == {"linears": 4, "cuda_linears": 2, "replanned": True, "trained": True, "ok": True}
    records[-1]["linears"]["2.out_proj"] = {**good, "main_grad": False}
    assert not check.judge("*M", records, replan, 0, te_check.evaluate_probe)["ok"]
    del records[-1]["linears"]["2.out_proj"]  # a Mamba linear SNIP did not plan
    assert check.judge("*M", records[:3], replan, 0, te_check.evaluate_probe)["ok"]
    assert not check.judge("*M", records, replan, 0, te_check.evaluate_probe)["ok"]
    assert not check.judge("*M", records[:3], [], 0, te_check.evaluate_probe)["ok"]  # no re-plan
    line = check.result_line({"pattern": "*M", "ok": False, "replanned": True})
    assert line.startswith("RESULT pattern=*M sm=skipped ") and line.endswith("replanned=1 trained=skipped "
                                                                              "seconds=skipped ok=0")
