"""bench/gpu/te_check.py on CPU: it cannot run its GPU parts here, so these tests cover what does not
need a GPU: the refusals (no GPU; no Transformer Engine for the parts that need it), the pure
functions (a Llama-70B layer's TP=8 GEMMs, the cost model from GEMM times in --snip-gemm-cost
syntax, the RESULT line, the pretrain probe's verdict), the start-up checks it makes (pure Python
at a given SM), and the recipe flags it shares with the CPU checks over the TE double."""

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT
from tests.pretrain.test_runs import needs_training

SCRIPT = ROOT / "bench" / "gpu" / "te_check.py"


@pytest.fixture(scope="module")
def te_check():
    spec = importlib.util.spec_from_file_location("bench_te_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_te_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_te_check", None)


@pytest.mark.launches
def test_the_script_refuses_without_a_gpu():
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "needs a CUDA GPU and Transformer Engine; this machine has no GPU" in proc.stderr


def test_main_refuses_without_a_gpu_and_without_te(te_check, monkeypatch):
    with pytest.raises(SystemExit, match=r"needs a CUDA GPU; this machine has no GPU"):
        te_check.main(["--only", "timing,availability"])
    with pytest.raises(SystemExit) as bad:
        te_check.main(["--only", "timing,bogus"])
    assert bad.value.code == 2  # argparse's error
    with pytest.raises(SystemExit) as bad:
        te_check.main(["--steps", "1"])
    assert bad.value.code == 2
    # A GPU without Transformer Engine: the parts that need it are refused, with TE's import error
    # and the parts that run without it.
    monkeypatch.setattr(te_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(te_check, "te_import_error", lambda: "import failed: ModuleNotFoundError: no te")
    with pytest.raises(SystemExit) as refused:
        te_check.main([])
    message = str(refused.value.code)
    assert "parts flags, warmup, gpt, pretrain need Transformer Engine (import failed: ModuleNotFoundError" in message
    assert "--only availability,timing" in message
    with pytest.raises(SystemExit, match="--only timing"):
        te_check.main(["--only", "timing,gpt"])


def test_parts_and_refusal(te_check):
    assert te_check.select_parts(None) == list(te_check.PARTS)
    assert te_check.select_parts(None, skip_pretrain=True) == ["availability", "timing", "flags", "warmup", "gpt"]
    assert te_check.select_parts("gpt, timing") == ["timing", "gpt"]  # run in PARTS order
    for bad in ("tming", "", ","):
        with pytest.raises(ValueError, match="choose from availability, timing"):
            te_check.select_parts(bad)
    assert te_check.refusal(["availability", "timing"], cuda=True, te_error="absent") is None
    assert te_check.refusal(list(te_check.PARTS), cuda=True, te_error=None) is None
    assert "a CUDA GPU;" in te_check.refusal(["timing"], cuda=False, te_error=None)


def test_recipe_flags_are_the_cpu_checks(te_check):
    tree = ast.parse((ROOT / "tests" / "te" / "megatron_checks.py").read_text())
    cpu_flags = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                     and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["RECIPE_FLAGS"])
    assert te_check.RECIPE_FLAGS == cpu_flags


def test_the_gemms_of_a_70b_layer_at_tp8(te_check):
    from snip_megatron.models import gpt

    shape = te_check.PRESETS["llama_70b"]
    # Llama-70B: hidden 8192, ffn 28672 (SwiGLU: fc1 gives 2x), 64 heads of 128, 8 KV groups.
    assert te_check.tp_linear_shapes(shape, 8) == {
        "linear_qkv": ((64 + 2 * 8) * 128 // 8, 8192), "linear_proj": (8192, 64 * 128 // 8),
        "linear_fc1": (2 * 28672 // 8, 8192), "linear_fc2": (8192, 28672 // 8)}
    assert te_check.tp_linear_shapes(shape, 1) == gpt.linear_shapes(shape)
    gemms = te_check.gemm_problems(shape, 8, 8192)
    assert len(gemms) == 12
    fc1 = {g.gemm: (g.m, g.n, g.k) for g in gemms if g.linear == "linear_fc1"}
    assert fc1 == {"fprop": (8192, 7168, 8192), "dgrad": (8192, 8192, 7168), "wgrad": (7168, 8192, 8192)}
    per_layer = sum(o * i for o, i in te_check.tp_linear_shapes(shape, 8).values())
    assert sum(g.flops for g in gemms) == 3 * 2 * 8192 * per_layer  # each GEMM has the same FLOPs
    with pytest.raises(ValueError, match="num_query_groups=8 is not divisible by tp=3"):
        te_check.tp_linear_shapes(shape, 3)
    with pytest.raises(ValueError, match="tokens must be a positive integer"):
        te_check.gemm_problems(shape, 8, 0)


def test_the_cost_model_from_gemm_times(te_check):
    from snip_megatron.config import SnipConfig

    times = {}
    for linear, scale in (("linear_qkv", 1.0), ("linear_fc1", 5.0)):
        for gemm in te_check.GEMMS:
            times[(linear, gemm, "bf16")] = 2e-3 * scale
            times[(linear, gemm, "fp8")] = 1e-3 * scale
    costs = te_check.cost_model(times)
    assert costs == {"bf16": 1.0, "fp8": pytest.approx(0.5), "fp4": None}
    # Each GEMM counts by its time: a slow FP8 GEMM on the big linear weighs more.
    times[("linear_fc1", "wgrad", "fp8")] = 10e-3
    assert te_check.cost_model(times)["fp8"] == pytest.approx((3 * 1 + 5 + 5 + 10) / (3 * 2 + 3 * 10))
    # A precision measured on some GEMMs only is compared with BF16 on those.
    partial = {("a", "fprop", "bf16"): 4.0, ("a", "dgrad", "bf16"): 100.0, ("a", "fprop", "fp4"): 1.0}
    assert te_check.cost_model(partial) == {"bf16": 1.0, "fp8": None, "fp4": 0.25}

    flag = te_check.gemm_cost_flag(costs, {"bf16": 1.0, "fp8": 0.5, "fp4": 1.0})
    assert flag == "bf16=1,fp8=0.5,fp4=1"  # fp4 not measured: the fallback (SNIP's model)
    assert te_check.gemm_cost_flag({"bf16": 1.0, "fp8": 0.61234, "fp4": 0.3333}, {}) == "bf16=1,fp8=0.612,fp4=0.333"
    assert SnipConfig(gemm_cost=flag).gemm_cost == flag  # what --snip-gemm-cost takes
    with pytest.raises(ValueError, match="must be > 0"):
        te_check.gemm_cost_flag({"bf16": 1.0, "fp8": 0.0, "fp4": 1.0}, {})


def test_the_result_line(te_check):
    line = te_check.result_line({"sm": 90, "te": "2.14.0", "fused_wgrad": "16/16", "stale": 0, "stale_rel": 1.23456e-7,
                                 "gemm_cost": "bf16=1,fp8=0.55,fp4=1", "parts": "availability,timing",
                                 "avail_agree": True, "ok": False})
    assert line.startswith("RESULT sm=90 te=2.14.0 mcore=skipped parts=availability,timing avail_agree=1 ")
    assert line.endswith(" ok=0")
    pairs = dict(kv.split("=", 1) for kv in line.split()[1:])
    assert list(pairs) == list(te_check.RESULT_KEYS)
    assert pairs["gemm_cost"] == "bf16=1,fp8=0.55,fp4=1" and pairs["stale_rel"] == "1.235e-07"
    assert pairs["pretrain"] == "skipped" and pairs["fused_wgrad"] == "16/16"
    assert " loss_first=ab " in te_check.result_line({"loss_first": "a b"})  # one token per value
    with pytest.raises(ValueError, match="not RESULT keys: stael"):
        te_check.result_line({"stael": 1})


def test_mixed_plans_hold_fp4_only_where_te_runs_it(te_check):
    from snip_megatron.formats.precision import Precision

    for fp4_runs in (False, True):
        cycle = te_check.plan_cycle(fp4_runs)
        a, b = te_check.plan_a(4, cycle), te_check.plan_b(4, cycle)
        assert set(a.values()) == set(cycle) and (Precision.FP4 in set(a.values())) == fp4_runs
        assert set(b.values()) <= set(cycle) and len(a.diff(b)) == 3


def _record(step, **changes):
    linears = {f"{layer}.{name}": {"precision": "fp8" if layer == 1 else "bf16", "moved": True, "main_grad": True,
                                   "fused": True} for layer in (1, 2) for name in ("linear_qkv", "linear_fc2")}
    record = {"step": step, "fusion": True, "precisions": ["bf16", "fp8"], "linears": linears}
    for key, value in changes.items():
        if key in ("fusion", "precisions"):
            record[key] = value
        else:
            linears["1.linear_fc2"][key] = value
    return record


def test_the_pretrain_probe_verdict(te_check):
    ok, report = te_check.evaluate_probe([_record(1), _record(2)], fp4_runs=False)
    assert ok and "all 4 planned linears fused, moved and with a nonzero main_grad" in report[0]
    assert te_check.evaluate_probe([], fp4_runs=False) == (False, ["the probe recorded no step"])
    for changes, says in ((dict(moved=False), "1.linear_fc2 (fp8): weight did not move"),
                          (dict(main_grad=False), "main_grad is zero or missing"),
                          (dict(fused=None), "not fused"),
                          (dict(fusion=False), "gradient_accumulation_fusion is False"),
                          (dict(precision="fp4"), "FP4 before SM100"),
                          (dict(precisions=["fp8", "fp4"]), "include fp4 before SM100")):
        ok, report = te_check.evaluate_probe([_record(1), _record(2, **changes)], fp4_runs=False)
        assert not ok and any(r.startswith("step 2: ") and says in r for r in report), (changes, report)
    ok, _ = te_check.evaluate_probe([_record(1, precision="fp4", precisions=["fp8", "fp4"])], fp4_runs=True)
    assert ok


def test_the_start_up_checks_at_a_given_sm(te_check):
    """The availability part without TE is SNIP's side alone, pure Python at a given SM: --snip
    alone plans BF16/FP8 before SM100 (FP4 asked is refused naming the emulated linears) and
    FP8/FP4 from SM100."""
    lines = []
    fields = te_check.check_availability(90, "import failed: absent here", lines.append)
    assert fields == {"te": "absent", "snip_default": "bf16,fp8", "fp4_refused": True, "_ok": True}, lines
    assert sum("refused naming the fix" in line for line in lines) == 4
    assert any(line.startswith("A. a plan with FP4 linears on SM90: refused") for line in lines)
    fields = te_check.check_availability(100, "import failed: absent here", lines.append)
    assert fields == {"te": "absent", "snip_default": "fp8,fp4", "fp4_refused": "n/a", "_ok": True}


@pytest.mark.launches
@needs_training
def test_the_pretrain_probe_on_cpu(te_check, tmp_path):
    """The pretrain part's worker (snip-pretrain-gpt with the probe on SNIP's controller) on CPU
    with SNIP's emulated linears (`--transformer-impl local`; TE's linears need the GPU): after
    every step each planned linear's weight moved and its main_grad is nonzero. On CPU Megatron's
    gradient-accumulation fusion is off (no apex) and the emulated linears have no TE fusion flag,
    so the probe's verdict names exactly those two and nothing else."""
    small = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings",
             "32", "--vocab-size", "256"]
    snip = ["--transformer-impl", "local", "--train-iters", "3", "--snip", "--snip-warmup", "1",
            "--snip-interval", "10", "--snip-lag", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--pretrain-worker", str(tmp_path), "--",
                           *te_check.PRETRAIN_MODEL, *small, *snip], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(len(r["linears"]) == 8 and r["fusion"] is False and r["precisions"] == ["fp8", "fp4"]
               for r in records)
    assert any(v["precision"] == "fp4" for v in records[-1]["linears"].values())  # a re-plan trained FP4
    ok, report = te_check.evaluate_probe(records, fp4_runs=True)
    assert not ok
    assert len(report) == 3 * (1 + 8)  # per step: fusion off, and each of the 8 linears not fused
    assert all(r.endswith(("gradient_accumulation_fusion is False, not Megatron-LM's default True",
                           "): not fused (fuse_wgrad_accumulation off)")) for r in report), report


DOUBLES = [ROOT / "tests" / "te_double", ROOT / "tests" / "apex_double"]
DRIVER = """
import json, sys
sys.path.insert(0, "bench/gpu")
import te_check
sm, fix = int(sys.argv[1]), sys.argv[2] == "fix"
if not fix:  # SNIP's turning TE's weight cache off where Megatron does not re-arm it, undone
    import snip_megatron.megatron.apply as apply
    apply.keep_te_weights_fresh = lambda module: False
out = {"mcore": te_check.mcore_version()}
if fix:
    out.update(te_check.check_warmup(print, device="cpu"))
out["gpt"] = te_check.check_te_spec_gpt(sm, sm >= 100, 2, 1e-3, print, device="cpu")
import importlib.util
if sm < 100 and not fix and importlib.util.find_spec("megatron.training") is not None:
    import subprocess, tempfile

    def through_the_probe_worker(args, out=None, timeout=600):
        # tests/pretrain/pretrain_worker.py: snip-pretrain-gpt reading the GPU generation from the double
        return subprocess.run([sys.executable, "tests/pretrain/pretrain_worker.py", tempfile.mkdtemp(), *args],
                              capture_output=True, text=True, timeout=timeout)

    te_check._pretrain = through_the_probe_worker
    out["refused"] = te_check.check_pretrain_refuses_fp4(sm, print)
print("RESULT_JSON " + json.dumps(out))
"""


def _over_the_doubles(sm: int, fix: bool) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "TE_DOUBLE_"))}
    env.update(PYTHONPATH=os.pathsep.join(map(str, [ROOT, *DOUBLES])), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", TE_DOUBLE_COMPUTE_CAPABILITY=f"{sm // 10}.{sm % 10}")
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(sm), "fix" if fix else "nofix"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT_JSON "), proc.stdout[-4000:]
    return json.loads(last.split(" ", 1)[1]), proc.stdout


@pytest.mark.launches
def test_warmup_and_gpt_parts_over_the_te_double_at_sm100():
    """The warmup and gpt parts with `device="cpu"` over the TE test double standing in for a B200
    (and the apex double, so Megatron's default gradient-accumulation fusion runs): every recipe
    survives two forwards before a backward; with a BF16/FP8/FP4 plan every planned TE linear is
    fused, moves and gets a main_grad; step 2 runs step 2's weights; the re-plan follows."""
    out, log = _over_the_doubles(100, fix=True)
    assert out["warmup"] == "8/8" and out["_ok"], log[-4000:]  # tensorwise, blockwise, mxfp8, nvfp4 x 2
    gpt = out["gpt"]
    assert gpt["fused_wgrad"] == "16/16" and gpt["stale"] == 0 and gpt["stale_rel"] <= 1e-3, log[-4000:]
    assert gpt["replanned"] == 3 and gpt["loss_last"] < gpt["loss_first"] and gpt["_ok"], log[-4000:]
    assert "plan {'bf16': 5, 'fp8': 6, 'fp4': 5}: delivered to 16 TE linears; 16 with fuse_wgrad_accumulation" in log


@pytest.mark.launches
def test_the_gpt_part_catches_stale_weights_and_sm90_refuses_fp4():
    """Stand-in SM90 with SNIP's weight-cache fix undone: on megatron-core < 0.19, which does not
    re-arm TE's cache for a quant_recipe, step 2's forwards run step 1's weights and the gpt part
    says so; from 0.19 Megatron re-arms it and the part passes. snip-pretrain-gpt with
    --snip-precisions fp8,fp4 exits 2 at start-up naming the fix."""
    out, log = _over_the_doubles(90, fix=False)
    version = tuple(int(v) for v in out["mcore"].split(".")[:2])
    gpt = out["gpt"]
    assert gpt["stale"] == int(version < (0, 19)), log[-4000:]
    assert ("<-- STALE" in log) == (version < (0, 19))
    assert gpt["fused_wgrad"] == "16/16" and "plan {'bf16': 8, 'fp8': 8, 'fp4': 0}" in log
    if version >= (0, 19):  # snip-pretrain-gpt needs megatron.training (megatron-core >= 0.19)
        assert out["refused"] is True, log[-3000:]
