"""Throughput of fake quantization (quantize + dequantize), in GB/s of input read.

Ours: snip_megatron.formats.quantize with the NVFP4 (1x16, E4M3 x FP32 scales), MXFP4 (1x32,
E8M0 RCEIL) and FP8 blockwise (1x128, FP32 scales) activation casts. Theirs: torchao's reference
quantizers on the same tensors, made into the same round trip (per-tensor amax ->
NVFP4Tensor.to_nvfp4 -> dequantize; MXTensor.to_mx(RCEIL) -> dequantize). Ceiling: a plain copy.

Runs 4096x4096 FP32 and BF16 on CPU, and on CUDA when present. Every method is timed in
round-robin (so load changes hit all alike) and the median is kept. The last line is

    RESULT nvfp4_vs_torchao=<r> mxfp4_vs_torchao=<r> nvfp4_vs_copy=<r> eager_nvfp4_vs_copy=<r>

ours / theirs (ours: the compiled CPU kernel where it runs; eager_*: the eager fused path), higher is better, each the geometric mean over the (device, dtype) cases.

    python bench/quantize_throughput.py [--size 4096] [--repeats 5] [--devices cpu,cuda]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import torch

import snip_megatron.formats.fused as fused
from snip_megatron.formats import FormatSpec, quantize

warnings.filterwarnings("ignore")


def our_methods():
    nvfp4 = FormatSpec.for_precision("fp4").fprop_input
    mxfp4 = FormatSpec.for_precision("fp4", fp4_recipe="mxfp4").fprop_input
    fp8 = FormatSpec.for_precision("fp8").fprop_input
    casts = {"nvfp4": nvfp4, "mxfp4": mxfp4, "fp8_blockwise": fp8}
    methods = {f"ours_{name}": (lambda x, c=cast: quantize(x, c)) for name, cast in casts.items()}
    # The eager fused path (what runs without the compiled CPU kernel), side by side.
    methods.update({f"eager_{name}": (lambda x, c=cast: _eager(x, c)) for name, cast in casts.items()})
    return methods


def _eager(x, cast):
    with fused.eager_cpu_path():
        return quantize(x, cast)


def torchao_methods():
    try:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor, ScaleCalculationMode
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    except Exception as e:  # torchao is a test/bench-only dependency
        raise SystemExit(f"this benchmark compares against torchao 0.18 ({e}); "
                         "pip install torchao==0.18.0") from e

    def nvfp4(x):
        scale = per_tensor_amax_to_scale(x.abs().amax())
        return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(x.dtype)

    def mxfp4(x):
        return MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32,
                              scaling_mode=ScaleCalculationMode.RCEIL).dequantize(x.dtype)

    return {"torchao_nvfp4": nvfp4, "torchao_mxfp4": mxfp4}


def time_round_robin(methods: dict, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds per call of each method."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for fn in methods.values():  # warm-up (allocator, lazy init)
        fn(x)
    times = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            sync()
            t0 = time.perf_counter()
            fn(x)
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", default="cpu,cuda", help="comma list; cuda is skipped if absent")
    args = parser.parse_args()

    methods = {"copy": torch.clone, **our_methods(), **torchao_methods()}
    ratios = {"nvfp4_vs_torchao": [], "mxfp4_vs_torchao": [], "nvfp4_vs_copy": [],
              "eager_nvfp4_vs_copy": []}
    print(f"threads={torch.get_num_threads()} size={args.size}x{args.size} repeats={args.repeats}")
    print(f"{'case':14s} " + " ".join(f"{name:>19s}" for name in methods) + "   (GB/s of input read)")
    for device in args.devices.split(","):
        if device == "cuda" and not torch.cuda.is_available():
            continue
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(args.size, args.size, generator=g, device=device).to(dtype)
            secs = time_round_robin(methods, x, args.repeats)
            gbps = {name: x.numel() * x.element_size() / s / 1e9 for name, s in secs.items()}
            case = f"{device}/{str(dtype).replace('torch.', '')}"
            print(f"{case:14s} " + " ".join(f"{gbps[name]:19.4g}" for name in methods))
            ratios["nvfp4_vs_torchao"].append(gbps["ours_nvfp4"] / gbps["torchao_nvfp4"])
            ratios["mxfp4_vs_torchao"].append(gbps["ours_mxfp4"] / gbps["torchao_mxfp4"])
            ratios["nvfp4_vs_copy"].append(gbps["ours_nvfp4"] / gbps["copy"])
            ratios["eager_nvfp4_vs_copy"].append(gbps["eager_nvfp4"] / gbps["copy"])
    geo = {k: math.exp(sum(math.log(r) for r in v) / len(v)) for k, v in ratios.items()}
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in geo.items()))


if __name__ == "__main__":
    main()
