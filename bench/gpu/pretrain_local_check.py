"""`snip-pretrain-gpt --transformer-impl local --bf16 --snip` on one GPU: the command Hopper users run
for FP4 studies (SNIP's emulated linears inside Megatron-LM's own loop), with no TE and no apex.

    python bench/gpu/pretrain_local_check.py                 # one GPU, no launcher
    python bench/gpu/pretrain_local_check.py --device cpu --tiny   # the same run on CPU (gloo)

It starts Megatron-LM as one rank without a launcher (single_gpu.py), on mock data, a 2-layer model,
`--snip-fp4-budget 0.5`, through te_check.py's probe on SNIP's controller, and checks: the run exits
0; on a GPU lacking TE's or apex's kernels SNIP said which flags it added; a measurement re-plans at
step 3; after every step every planned linear's weight moved and its main_grad is nonzero; the last
plan holds at least the budget's share of the linear FLOPs in FP4 (weights' sizes as FLOPs per
token). Last line: `RESULT device=<d> steps=<n> flags_line=<0|1> replanned=<0|1> trained=<ok
steps>/<steps> fp4_share=<x> seconds=<s> ok=<0|1>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from single_gpu import ROOT, single_process_env  # noqa: E402

MODEL = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "128",
         "--max-position-embeddings", "128", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--bf16",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--mock-data", "--log-interval", "1",
         "--eval-iters", "1", "--eval-interval", "100"]
"""te_check's pretrain model: Megatron-LM's defaults otherwise (SNIP adds the kernel flags it lacks)."""
TINY = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32",
        "--vocab-size", "256"]
FP4_BUDGET = 0.5


def snip_flags(steps: int) -> list[str]:
    return ["--transformer-impl", "local", "--train-iters", str(steps), "--snip", "--snip-warmup", "2",
            "--snip-interval", "10", "--snip-lag", "1", "--snip-fp4-budget", str(FP4_BUDGET)]


def judge(records: list[dict], lines: list[str], returncode: int, cuda: bool) -> dict:
    """The verdict of one run from the probe's records and SNIP's `[snip]` lines."""
    trained = sum(1 for r in records
                  if r["linears"] and all(v["moved"] and v["main_grad"] for v in r["linears"].values()))
    last = records[-1]["linears"] if records else {}
    total = sum(v["numel"] for v in last.values())
    fp4_share = sum(v["numel"] for v in last.values() if v["precision"] == "fp4") / total if total else 0.0
    flags_line = any(line.startswith("[snip] this GPU lacks") for line in lines)
    replanned = any(line.startswith("[snip] step 3: plan") for line in lines)
    ok = (returncode == 0 and replanned and records != [] and trained == len(records)
          and fp4_share >= FP4_BUDGET - 1e-9 and (flags_line or not cuda or not _lacks_kernels()))
    return {"flags_line": int(flags_line), "replanned": int(replanned), "trained": f"{trained}/{len(records)}",
            "fp4_share": round(fp4_share, 3), "ok": int(ok)}


def _lacks_kernels() -> bool:
    sys.path.insert(0, ROOT)
    from snip_megatron.pretrain.cpu import missing_gpu_kernels

    return bool(missing_gpu_kernels())


def run(args: list[str], timeout: int) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """te_check.py's pretrain worker (snip-pretrain-gpt with the probe) as one rank; its records."""
    with tempfile.TemporaryDirectory(prefix="pretrain_local_") as tmp:
        proc = subprocess.run([sys.executable, str(HERE / "te_check.py"), "--pretrain-worker", tmp, "--", *args],
                              cwd=ROOT, env=single_process_env(), capture_output=True, text=True, timeout=timeout)
        probe = Path(tmp) / "probe.jsonl"
        records = [json.loads(line) for line in probe.read_text().splitlines()] if probe.exists() else []
    return proc, records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a smaller model (for CPU)")
    ap.add_argument("--steps", type=int, default=8, help="training iterations (at least 4: a re-plan at step 3)")
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error("--steps must be at least 4")
    import torch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu")
    start = time.perf_counter()
    proc, records = run([*MODEL, *(TINY if args.tiny else []), *snip_flags(args.steps)], args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[snip]")]
    for line in lines:
        print(line, flush=True)
    if proc.returncode != 0:
        print(f"snip-pretrain-gpt failed ({proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
    verdict = judge(records, lines, proc.returncode, cuda)
    print(f"RESULT device={args.device} steps={args.steps} " + " ".join(f"{k}={v}" for k, v in verdict.items()
          if k != "ok") + f" seconds={time.perf_counter() - start:.0f} ok={verdict['ok']}", flush=True)
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
