"""snip-pretrain-hybrid on a real GPU with Mamba (M) or gated-delta-net (G) layers: what CPU runs
cannot show, since those layers run CUDA kernels (mamba_ssm and causal_conv1d for M, fla for G)
and SNIP refuses them at start-up without a GPU (tests/pretrain/test_hybrid_runs.py runs `*-*-`
and `*-|*-` on CPU over the TE double).

    python bench/gpu/hybrid_check.py                          # pattern '*M*-', 6 steps
    python bench/gpu/hybrid_check.py --pattern 'M*M-G*M-'     # GDN too (needs fla)

Runs `snip-pretrain-hybrid --transformer-impl transformer_engine --snip` on mock data in a
subprocess with a probe on SNIP's controller (te_check.py's), sized for about two minutes on one
H200 (hidden 256, sequence 256, measurement at step 2, re-plan at step 3). It checks: start-up
passes (SNIP's GPU line printed), the plan covers every planned linear of the pattern (Mamba's
mixer.in_proj/out_proj and GDN's self_attention.in_proj/out_proj as `<layer>.in_proj` /
`<layer>.out_proj`, keyed by hybrid layer number) and is re-planned after a measurement, and after
every step every planned linear's weight moved and its main_grad is nonzero (te_check.py's
`evaluate_probe`). Last line: `RESULT <key>=<value> ...` with RESULT_KEYS.

Refuses to start without a CUDA GPU, without Transformer Engine, or without the kernels the
pattern's layers need, naming them. Never run: no machine with a GPU, TE and mamba_ssm was
available (bench/gpu/README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = str(HERE.parents[1])
sys.path.insert(0, ROOT)
sys.path.insert(0, str(HERE))  # its sibling single_gpu.py, when loaded by path

from snip_megatron.models import hybrid  # noqa: E402

KERNELS = {"M": ("mamba_ssm", "causal_conv1d"), "G": ("fla",)}
"""The CUDA-kernel packages each layer symbol needs (Megatron's MambaMixer, GatedDeltaNet)."""
RESULT_KEYS = ("pattern", "sm", "te", "mcore", "linears", "cuda_linears", "replanned", "trained", "seconds", "ok")
"""The keys of the RESULT line, in order."""
MODEL = ["--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "256",
         "--max-position-embeddings", "256", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16",
         "--mamba-num-groups", "2", "--mamba-head-dim", "64", "--mamba-state-dim", "128",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
         "--lr-decay-style", "cosine", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
         "--mock-data", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
         "--transformer-impl", "transformer_engine"]
SNIP = ["--snip", "--snip-warmup", "2", "--snip-interval", "3", "--snip-lag", "1"]


def run_worker(out: str, flags: list[str], timeout: int = 900):
    """This script's `--worker` (snip-pretrain-hybrid with the probe) as one rank without a launcher
    (Megatron-LM's process group reads MASTER_ADDR/PORT: single_gpu.py)."""
    from single_gpu import single_process_env

    return subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", out, "--", *flags], cwd=ROOT,
                          env=single_process_env(), capture_output=True, text=True, timeout=timeout)


def load_te_check():
    """bench/gpu/te_check.py as a module: its probe verdict and version helpers."""
    spec = importlib.util.spec_from_file_location("bench_te_check", HERE / "te_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_te_check"] = module
    spec.loader.exec_module(module)
    return module


# -- pure helpers (tested on CPU) ------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    """The check's arguments; argparse's error (exit 2) for a pattern SNIP cannot plan, one with no
    Mamba or GDN layer (CPU runs cover those), or fewer than 4 steps."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pattern", default="*M*-", help="--hybrid-layer-pattern with M and/or G layers")
    ap.add_argument("--steps", type=int, default=6, help="training steps (>= 4: measured at 2, re-planned at 3)")
    ap.add_argument("--snip-flags", default="", help="more --snip* flags, e.g. '--snip-fp8-budget 0.5'")
    args = ap.parse_args(argv)
    try:
        symbols = hybrid.layer_symbols(args.pattern)
    except ValueError as e:
        ap.error(str(e))
    if hybrid.MOE in symbols:
        ap.error(f"--pattern {args.pattern!r} has MoE (E) layers: this check passes no --num-experts; CPU runs "
                 "cover E layers over the TE double (tests/pretrain/test_hybrid_runs.py)")
    if not any(c in KERNELS for c in symbols):
        ap.error(f"--pattern {args.pattern!r} has no Mamba (M) or GDN (G) layer; CPU runs cover '*' and '-' "
                 "(tests/pretrain/test_hybrid_runs.py)")
    if args.steps < 4:
        ap.error("--steps must be at least 4 (measured at step 2, re-planned at step 3)")
    return args


def needed_kernels(pattern: str) -> list[str]:
    """The kernel packages the pattern's layers need, in pattern order."""
    return list(dict.fromkeys(m for c in hybrid.layer_symbols(pattern) for m in KERNELS.get(c, ())))


def refusal(cuda: bool, te_error: "str | None", missing: list[str]) -> "str | None":
    """Why this machine cannot run the check (None when it can)."""
    if not cuda:
        return ("hybrid_check.py needs a CUDA GPU, Transformer Engine and the Mamba/GDN kernels; this machine "
                "has no GPU (on CPU SNIP refuses M and G layers at start-up)")
    if te_error is not None:
        return f"hybrid_check.py needs Transformer Engine ({te_error}); use the NGC PyTorch image (docker/)"
    if missing:
        return f"hybrid_check.py: the pattern's layers need {', '.join(missing)}, not importable here"
    return None


def cuda_linears(pattern: str) -> list[str]:
    """The keys of the pattern's Mamba and GDN linears ("<layer>.in_proj", ...)."""
    symbols = hybrid.layer_symbols(pattern)
    return [f"{i + 1}.{slot.name}" for i, c in enumerate(symbols) if c in KERNELS for slot in hybrid.LINEARS[c]]


def pattern_keys(pattern: str) -> list[str]:
    """Every planned linear's key of the pattern, in forward order."""
    symbols = hybrid.layer_symbols(pattern)
    return [f"{i + 1}.{slot.name}" for i, c in enumerate(symbols) for slot in hybrid.LINEARS[c]]


def judge(pattern: str, records: list[dict], lines: list[str], returncode: int, evaluate_probe) -> dict:
    """The verdict over the run's `[snip]` lines and the probe's records (te_check.py's format)."""
    keys = pattern_keys(pattern)
    seen = sorted(records[-1]["linears"]) if records else []
    trained, _ = evaluate_probe(records, fp4_runs=True)
    replanned = any(line.startswith("[snip] step 3: plan") for line in lines)
    covered = seen == sorted(keys)
    return {"linears": len(seen), "cuda_linears": sum(k in seen for k in cuda_linears(pattern)),
            "replanned": replanned, "trained": trained,
            "ok": returncode == 0 and covered and replanned and trained}


def result_line(fields: dict) -> str:
    """`RESULT k=v ...` over RESULT_KEYS (a missing key reads `skipped`)."""
    unknown = sorted(set(fields) - set(RESULT_KEYS))
    if unknown:
        raise ValueError(f"not RESULT keys: {', '.join(unknown)}")
    values = {k: fields.get(k, "skipped") for k in RESULT_KEYS}
    return "RESULT " + " ".join(f"{k}={int(v) if isinstance(v, bool) else str(v).replace(' ', '')}"
                                for k, v in values.items())


# -- this machine ----------------------------------------------------------------------------------
def missing_kernels(pattern: str) -> list[str]:
    return [m for m in needed_kernels(pattern) if importlib.util.find_spec(m) is None]


def worker(argv: list[str]) -> int:
    """`hybrid_check.py --worker OUT -- <snip-pretrain-hybrid arguments>`: te_check.py's probe on
    SNIP's controller (OUT/probe.jsonl), around snip-pretrain-hybrid."""
    import functools

    from snip_megatron.pretrain import entry

    te_check = load_te_check()
    entry.main = functools.partial(entry.main, family="hybrid")  # te_check's worker runs entry.main
    return te_check.pretrain_worker(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    args = parse_args(argv)
    import torch

    te_check = load_te_check()
    cuda = torch.cuda.is_available()
    te_error = te_check.te_import_error() if cuda else None
    why = refusal(cuda, te_error, missing_kernels(args.pattern) if cuda else [])
    if why:
        raise SystemExit(why)
    from snip_megatron.te import gpu

    start = time.perf_counter()
    fields = {"pattern": args.pattern, "sm": gpu.current_sm(), "te": te_check.te_version(),
              "mcore": te_check.mcore_version()}
    print(f"GPU {torch.cuda.get_device_name()} = SM{fields['sm']}; TE {fields['te']}; megatron-core "
          f"{fields['mcore']}; pattern {args.pattern!r}", flush=True)
    flags = [*MODEL, "--hybrid-layer-pattern", args.pattern, "--train-iters", str(args.steps), *SNIP,
             *args.snip_flags.split()]
    with tempfile.TemporaryDirectory(prefix="hybrid_check_") as tmp:
        proc = run_worker(tmp, flags)
        probe = Path(tmp) / "probe.jsonl"
        records = [json.loads(line) for line in probe.read_text().splitlines()] if probe.exists() else []
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[snip]")]
    for line in lines:
        print(line, flush=True)
    if proc.returncode != 0:
        print(f"snip-pretrain-hybrid failed ({proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
    fields.update(judge(args.pattern, records, lines, proc.returncode, te_check.evaluate_probe))
    fields["seconds"] = round(time.perf_counter() - start)
    print(result_line(fields), flush=True)
    return 0 if fields["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
