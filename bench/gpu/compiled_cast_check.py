"""Check the compiled cast (snip_megatron/formats/compiled.py, `SNIP_COMPILED_CAST=1`) on a GPU:
does Inductor's Triton code give the eager fused path's bits, what does compiling cost on first
use, and how fast is it against the eager path and a plain copy?

For every recipe and GEMM role SNIP casts (FP8 blockwise, tensorwise, MXFP8, NVFP4 with its 2D
weight tiles, RHT and stochastic rounding, MXFP4), on `--device` tensors:
1. agreement: the compiled graph's output against the eager fused path's, bit for bit (NaN where
   NaN), on random data with ties, zeros, an outlier, Inf and NaN planted (compiled.py's own
   first-call check, read back: a key that differs is reported and would run eager in training);
2. first use: the seconds of the first call (compiling included), per key;
3. speed, at `--size` (default 8192 x 8192 BF16, an H200-sized activation): median time per cast of
   the compiled graph, the eager fused path and `clone`, round robin.

    SNIP_COMPILED_CAST=1 python bench/gpu/compiled_cast_check.py            # CUDA
    python bench/gpu/compiled_cast_check.py --device cpu --size 256 --only nvfp4:fprop_input

Last line: `RESULT device=<d> keys=<n> agree=<n> first_call_s_max=<s> compiled_vs_eager=<x>
compiled_vs_copy=<x> eager_vs_copy=<x> ok=<0|1>` (speed ratios: geometric means over the keys,
higher is faster; ok: every key agrees). The CPU run is a smoke test of this script: CPU casts in
training take the C++ kernel, not this graph.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

os.environ["SNIP_COMPILED_CAST"] = "1"

import snip_megatron.formats.cpu_kernel as cpu_kernel  # noqa: E402
from snip_megatron.formats import Formats, Role, Rounding, compiled, quantize  # noqa: E402

RECIPES = {"blockwise": Formats().spec("fp8"), "tensorwise": Formats(fp8_recipe="tensorwise").spec("fp8"),
           "mxfp8": Formats(fp8_recipe="mxfp8").spec("fp8"), "nvfp4": Formats().spec("fp4"),
           "mxfp4": Formats(fp4_recipe="mxfp4").spec("fp4")}


def probe(rows: int, cols: int, device, seed: int = 0) -> torch.Tensor:
    """Random data with ties, zeros, an outlier, Inf and NaN in separate blocks, in BF16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[0, :64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 8)  # E2M1 ties at scale 1
    x[1, :128] = 0.0
    x[2, 5] = 3e4
    if rows > 32:
        x[32, 7] = float("inf")
        x[33, 9] = float("nan")
    return x.bfloat16().to(device)


def keys(only: str | None):
    for name, spec in RECIPES.items():
        for role in Role:
            if only and f"{name}:{role.value}" not in only.split(","):
                continue
            yield name, role, spec.cast(role)


def timed(fn, x, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn(x)
    sync()
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--only", default=None, help="comma list of recipe:role keys (default: all)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":  # the graph serves GPUs; on CPU, for this smoke test, it is forced
        cpu_kernel.USE_CPU_KERNEL = False
        compiled.serves = lambda x, want_codes, amax_group: not want_codes
    compiled.reset()
    check = probe(256, 512, device)
    big = probe(args.size, args.size, device, seed=1).float().clamp(-1e3, 1e3).bfloat16()
    big = torch.nan_to_num(big)
    agree, first, speed = 0, [], {"compiled_vs_eager": [], "compiled_vs_copy": [], "eager_vs_copy": []}
    rows = list(keys(args.only))
    print(f"device={device} size={args.size} keys={len(rows)}")
    print(f"{'recipe:role':34s} {'agree':>5s} {'first s':>8s} {'compiled ms':>12s} {'eager ms':>9s} {'copy ms':>8s}")
    for name, role, cast in rows:
        dim = role.contraction_dim

        def noise_for(x):
            if cast.rounding is not Rounding.STOCHASTIC:
                return None
            return torch.rand(x.shape, device=x.device, generator=torch.Generator(x.device).manual_seed(2))

        u_check = noise_for(check)
        before = dict(compiled._VERDICT)
        start = time.perf_counter()
        quantize(check, cast, dim=dim, noise=u_check)  # compiles, and checks against the eager path
        if device.type == "cuda":
            torch.cuda.synchronize()
        first.append(time.perf_counter() - start)
        new = [v for k, v in compiled._VERDICT.items() if k not in before]
        ok = all(new) if new else all(compiled._VERDICT.values())  # a key seen before: its verdict stands
        agree += ok
        u_big = noise_for(big)
        methods = {"compiled": lambda x: quantize(x, cast, dim=dim, noise=u_big),
                   "eager": lambda x: _eager(x, cast, dim, u_big), "copy": torch.clone}
        for fn in methods.values():
            fn(big)  # warm-up (a new shape may compile once more)
        times = {m: [] for m in methods}
        for _ in range(args.repeats):
            for m, fn in methods.items():
                times[m].append(timed(fn, big, device))
        ms = {m: statistics.median(t) * 1e3 for m, t in times.items()}
        speed["compiled_vs_eager"].append(ms["eager"] / ms["compiled"])
        speed["compiled_vs_copy"].append(ms["copy"] / ms["compiled"])
        speed["eager_vs_copy"].append(ms["copy"] / ms["eager"])
        print(f"{name + ':' + role.value:34s} {ok!s:>5s} {first[-1]:8.2f} {ms['compiled']:12.3f} "
              f"{ms['eager']:9.3f} {ms['copy']:8.3f}")
    geo = {k: math.exp(sum(math.log(r) for r in v) / len(v)) for k, v in speed.items()}
    ok = agree == len(rows)
    print(f"RESULT device={device.type} keys={len(rows)} agree={agree} first_call_s_max={max(first):.2f} "
          + " ".join(f"{k}={v:.3f}" for k, v in geo.items()) + f" ok={int(ok)}")
    return 0 if ok else 1


def _eager(x, cast, dim, noise):
    """The eager fused path, side by side: the compiled graph switched off for this call."""
    serves = compiled.serves
    compiled.serves = lambda *a: False
    try:
        return quantize(x, cast, dim=dim, noise=noise)
    finally:
        compiled.serves = serves


if __name__ == "__main__":
    sys.exit(main())
