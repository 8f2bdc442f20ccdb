"""bench/quality.py on one lent GPU, sized for about eight minutes: the comparison that tells the most.

    python bench/gpu/quality_gpu.py            # rerun the same command to resume an interrupted run
    python bench/gpu/quality_gpu.py --seeds 5 --steps 1500   # any bench/quality.py flag overrides

The model is larger than the CPU benchmark's (12 layers, hidden 512, 48 planned linears, 4096 tokens
per step) and the methods are the five that decide the question a user asks, at FP4 budget 80%: BF16,
uniform NVFP4, the recipe (last_fraction: the last layers high), the best fixed rule of the CPU
benchmark (read from its log, docs/quality_runs.jsonl) and SNIP periodic; 3 seeds, each from a shared
500-step BF16 prefix, 300 quantized steps. What it would show: whether SNIP's lead over the recipe and
the best rule on CPU holds on a larger model that trains on real GPU kernels (FP8/FP4 emulated: no
Transformer Engine is needed), pair by pair, with uniform FP4 saying how much FP4 costs there.

Every run is a separate process on the one GPU (8 at a time). Writes docs/results_gpu.md and
runs/quality_gpu/results.jsonl, and always resumes from that log; the last line is bench/quality.py's
RESULT line (its 75% and oracle keys read nan: this subset runs neither). Refuses to start without
CUDA unless given `--device cpu` (the same command on a CPU, with tiny flags: run_all.sh's dry run).

Not run yet in this project: no GPU was lent when it was written, so the eight minutes are an
estimate (about 70 ms per emulated FP4 step of this model, 15 runs); the printed per-run seconds
correct it. The model path it uses on CUDA (batches moved to the model's device, fused kernels off
without TE) is tested on CPU only.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

CPU_LOG = ROOT / "docs" / "quality_runs.jsonl"
"""The CPU quality benchmark's results log: where the best fixed rule comes from."""
BUDGET = 0.8

# Multiples of 128 everywhere: FP8 blocks and FP4 blocks never straddle a tensor-parallel shard.
GPU_DEFAULTS = [
    "--layers", "12", "--hidden", "512", "--ffn", "1408", "--heads", "8", "--groups", "4",
    "--seq", "256", "--vocab", "8192", "--micro-batch-size", "16", "--steps", "800", "--prefix-steps", "500",
    "--max-bytes", "30000000", "--jobs", "8", "--seeds", "3", "--formats", "nvfp4", "--budgets", str(BUDGET),
    "--run-dir", "runs/quality_gpu", "--out", str(ROOT / "docs" / "results_gpu.md"), "--resume",
]


def best_cpu_rule(log: Path = CPU_LOG, fmt: str = "nvfp4", budget: float = BUDGET) -> str:
    """The fixed rule with the smallest mean gap at `budget` in the CPU benchmark's log."""
    import quality

    if not log.exists():
        raise SystemExit(f"{log} is missing: run bench/quality.py on a CPU first (its log names the best rule), "
                         "or pass --methods")
    results = [r for r in quality.read_log(log) if isinstance(r.get("spec"), dict)]
    summary = quality.summarize(results, fmt, [budget], quality.HEURISTICS)
    rules = [(r["gap_mean"], r["method"]) for r in summary["rows"]
             if r["method"] in quality.HEURISTICS and r["budget"] == budget]
    if not rules:
        raise SystemExit(f"{log} has no fixed rule at {fmt} {budget:.0%}: rerun bench/quality.py with that budget, "
                         "or pass --methods")
    return min(rules)[1]


def gpu_argv(argv: list[str]) -> list[str]:
    """The GPU defaults and method subset, then the user's flags (argparse keeps the last value of a
    repeated flag; --methods replaces the subset)."""
    import quality

    recipe = quality.RECIPES[0]  # last_fraction: the last layers high
    methods = [] if "--methods" in argv else \
        ["--methods", ",".join(dict.fromkeys(["uniform_fp4", recipe, best_cpu_rule(), "snip_periodic"]))]
    return GPU_DEFAULTS[:] + methods + argv


def main(argv=None) -> None:
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    device = "cuda"
    if "--device" in argv:  # `--device cpu`: the same command on a CPU (run_all.sh's dry run, tiny flags)
        i = argv.index("--device")
        device = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i:i + 2]
        if device not in ("cuda", "cpu"):
            raise SystemExit(f"--device {device}: cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu/quality_gpu.py needs a CUDA GPU; on a CPU run bench/quality.py "
                         "(or this script with --device cpu)")
    import quality

    quality.main(gpu_argv(argv))


if __name__ == "__main__":
    main()
