"""What one emulated linear costs: forward + backward (its three GEMMs and their casts) per recipe, on
each GEMM path of emulation/gemm.py (tensor_core, fp32), against the same linear in BF16.

    python bench/gpu/linear_timing.py                               # CUDA, a Llama-70B fc1 shard at TP=8
    python bench/gpu/linear_timing.py --device cpu --shape 2048,1024,1024   # the CPU measurement

Prints one line per recipe (milliseconds per path and the ratio to BF16) and the faster path, then
`RESULT device=<d> shape=<t,i,o> bf16_ms=<t> <recipe>=<tensor_core ms>/<fp32 ms> ... faster=<path
per recipe> ok=1`. Inputs and weights are BF16, as in training; the recipes are the default FP8
(blockwise, FP32 scales), its pow2 variant, tensorwise, MXFP8, NVFP4 and MXFP4. Which path a device
runs by default is `emulation/gemm.py` DEFAULT_PATH: this script is where that choice is measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from snip_megatron.emulation.gemm import PATHS  # noqa: E402
from snip_megatron.emulation.quantized_linear import QuantRuntime, quantized_linear  # noqa: E402
from snip_megatron.formats import Formats, FormatSpec  # noqa: E402
from snip_megatron.formats.sr_noise import SeedStream  # noqa: E402

SHAPE = (8192, 8192, 7168)
"""tokens, in, out: Llama-70B's linear_fc1 on one of 8 TP ranks (SwiGLU: 2 x 28672 / 8), 8192 tokens."""
RECIPES = {"fp8": ("fp8", Formats()), "fp8_pow2": ("fp8", Formats(fp8_block_scales="pow2")),
           "tensorwise": ("fp8", Formats(fp8_recipe="tensorwise")), "mxfp8": ("fp8", Formats(fp8_recipe="mxfp8")),
           "nvfp4": ("fp4", Formats()), "mxfp4": ("fp4", Formats(fp4_recipe="mxfp4"))}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_linear(spec: FormatSpec, shape: tuple[int, int, int], device: torch.device, iters: int,
                gemm: "str | None" = None) -> float:
    """Median seconds of one linear's forward + backward in `spec` on GEMM path `gemm` (None: the
    device's default), BF16 operands."""
    tokens, n_in, n_out = shape
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(tokens, n_in, device=device, generator=g).bfloat16().requires_grad_()
    w = (0.02 * torch.randn(n_out, n_in, device=device, generator=g)).bfloat16().requires_grad_()
    gy = torch.randn(tokens, n_out, device=device, generator=g).bfloat16()
    runtime = QuantRuntime(generator=SeedStream(6), gemm=gemm)
    times = []
    for i in range(iters + 1):  # the first is a warm-up
        sync(device)
        start = time.perf_counter()
        quantized_linear(x, w, None, spec, runtime).backward(gy)
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
        x.grad = w.grad = None
    return statistics.median(times)


def time_recipes(shape, device: torch.device, iters: int, recipes=tuple(RECIPES), paths=PATHS) -> dict:
    """{"bf16": s, recipe: {path: s}} of `time_linear`."""
    out = {"bf16": time_linear(FormatSpec.for_precision("bf16"), shape, device, iters)}
    for name in recipes:
        precision, formats = RECIPES[name]
        out[name] = {path: time_linear(formats.spec(precision), shape, device, iters, path) for path in paths}
    return out


def report(times: dict, shape, device: str, log=print) -> str:
    """One line per recipe and the RESULT line (returned)."""
    bf16 = times["bf16"]
    fields, faster = [], []
    for name, by_path in times.items():
        if name == "bf16":
            continue
        best = min(by_path, key=by_path.get)
        faster.append(f"{name}:{best}")
        log(f"{name:10s} " + "  ".join(f"{p} {t * 1e3:8.2f} ms ({t / bf16:5.2f}x BF16)" for p, t in by_path.items())
            + f"  faster: {best}")
        fields.append(f"{name}=" + "/".join(f"{by_path[p] * 1e3:.2f}" for p in PATHS if p in by_path))
    line = (f"RESULT device={device} shape={','.join(map(str, shape))} bf16_ms={bf16 * 1e3:.2f} "
            + " ".join(fields) + f" faster={','.join(faster)} ok=1")
    log(line)
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", default=",".join(map(str, SHAPE)), help="tokens,in,out")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"a subset of {', '.join(RECIPES)}")
    args = ap.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    recipes = [r for r in args.recipes.split(",") if r]
    if len(shape) != 3 or min(shape) < 1 or any(r not in RECIPES for r in recipes):
        ap.error(f"--shape tokens,in,out of positive ints; --recipes from {', '.join(RECIPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu")
    device = torch.device(args.device)
    print(f"one linear {shape[2]}x{shape[1]} on {shape[0]} tokens, forward + backward, BF16 inputs, on "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}", flush=True)
    times = time_recipes(shape, device, args.iters, recipes)
    print(f"bf16       {times['bf16'] * 1e3:8.2f} ms", flush=True)
    report(times, shape, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
