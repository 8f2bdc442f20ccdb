"""bench/quality.py on a GPU: the same methods, budgets, seeds and report, on a larger model.

    python bench/gpu/quality_gpu.py            # 12 layers, hidden 512, 1000 steps (500 shared), 8 runs at a time
    python bench/gpu/quality_gpu.py --quick    # budgets 75/80, the best heuristics, 2 seeds
    python bench/gpu/quality_gpu.py --steps 3000 --jobs 12   # any bench/quality.py flag overrides

Every run is a separate process on the one GPU (CUDA + NCCL, one rank each), with the emulated
FP8/FP4 linears (no Transformer Engine needed). Writes docs/results_gpu.md and
runs/quality_gpu/results.jsonl (`--resume` continues an interrupted run); the last line is
bench/quality.py's RESULT line. Refuses to start without CUDA (use bench/quality.py on a CPU).

Not run yet in this project: no GPU was lent when it was written. The model path it uses on CUDA
(batches moved to the model's device, fused kernels off without TE) is tested on CPU only.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

# Multiples of 128 everywhere: FP8 blocks and FP4 blocks never straddle a tensor-parallel shard.
GPU_DEFAULTS = [
    "--layers", "12", "--hidden", "512", "--ffn", "1408", "--heads", "8", "--groups", "4",
    "--seq", "256", "--vocab", "8192", "--micro-batch-size", "16", "--steps", "1000", "--prefix-steps", "500",
    "--max-bytes", "30000000", "--jobs", "8",
    "--run-dir", "runs/quality_gpu", "--out", str(ROOT / "docs" / "results_gpu.md"),
]


def gpu_argv(argv: list[str]) -> list[str]:
    """The GPU defaults, then the user's flags (argparse keeps the last value of a repeated flag)."""
    if "--quick" in argv and "--steps" not in argv:
        return GPU_DEFAULTS[:] + ["--steps", "400", "--prefix-steps", "200"] + argv
    return GPU_DEFAULTS[:] + argv


def main(argv=None) -> None:
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu/quality_gpu.py needs a CUDA GPU; on a CPU run bench/quality.py")
    import quality

    quality.main(gpu_argv(argv))


if __name__ == "__main__":
    main()
