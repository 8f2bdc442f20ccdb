"""Throughput of fake quantization (quantize + dequantize), in GB/s of input read.

Ours: snip_megatron.formats.quantize with the NVFP4 (1x16, E4M3 x FP32 scales), MXFP4 (1x32,
E8M0 RCEIL) and FP8 blockwise (1x128, FP32 scales) activation casts. Theirs: torchao's reference
quantizers on the same tensors, made into the same round trip (per-tensor amax ->
NVFP4Tensor.to_nvfp4 -> dequantize; MXTensor.to_mx(RCEIL) -> dequantize). Ceiling: a plain copy.

Runs 4096x4096 FP32 and BF16 on CPU, and on CUDA when present. Every method is timed in
round-robin (so load changes hit all alike) and the median is kept.

Each output is a fresh tensor, and on CPU a 4096x4096 one is larger than the most glibc's malloc
serves from its heap (32 MiB), so by default every call maps new pages and the kernel faults them
in and zeroes them as the method writes (about 30 ms of a 64 MiB output on a 2-core machine: as
long as the cast's own work). Which method gets pages that are already mapped then depends on
the allocator's history, not on the method. So the CPU cases run twice: first with the allocator
as it is ("fresh pages"), then with freed memory kept mapped (mallopt: no mmap below 2 GiB, no
trim), where every method writes into warm memory and the ratios compare the work of the casts.
The last line is

    RESULT nvfp4_vs_torchao=<r> mxfp4_vs_torchao=<r> nvfp4_vs_copy=<r> eager_nvfp4_vs_copy=<r>
           nvfp4_vs_copy_fresh_pages=<r> eager_nvfp4_vs_copy_fresh_pages=<r>

ours / theirs (ours: the compiled CPU kernel where it runs; eager_*: the eager fused path), higher
is better, each the geometric mean over the (device, dtype) cases; the first four with memory
kept mapped (CUDA's caching allocator always does), the *_fresh_pages ones as the allocator is.

    python bench/quantize_throughput.py [--size 4096] [--repeats 5] [--devices cpu,cuda]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import time
import warnings

import torch

from snip_megatron.formats import FormatSpec, quantize
from snip_megatron.formats.cpu_kernel import eager_cpu_path

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
    with eager_cpu_path():
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


def keep_freed_memory_mapped() -> bool:
    """glibc: serve every allocation below 2 GiB from the heap and never trim it, so a freed
    output's pages stay mapped for the next one. False where that cannot be set (not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, ctypes.c_int(2**31 - 1))
                    and libc.mallopt(m_trim_threshold, ctypes.c_int(2**31 - 1)))
    except Exception:
        return False


def measure(methods: dict, device: str, size: int, repeats: int, label: str) -> dict:
    """GB/s of input read of each method on (device, dtype) cases, printed; {case: {name: GB/s}}."""
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(size, size, generator=g, device=device).to(dtype)
        secs = time_round_robin(methods, x, repeats)
        gbps = {name: x.numel() * x.element_size() / s / 1e9 for name, s in secs.items()}
        case = f"{device}/{str(dtype).replace('torch.', '')}"
        print(f"{case + label:26s} " + " ".join(f"{gbps[name]:19.4g}" for name in methods))
        results[case] = gbps
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", default="cpu,cuda", help="comma list; cuda is skipped if absent")
    args = parser.parse_args()

    methods = {"copy": torch.clone, **our_methods(), **torchao_methods()}
    devices = [d for d in args.devices.split(",") if d != "cuda" or torch.cuda.is_available()]
    print(f"threads={torch.get_num_threads()} size={args.size}x{args.size} repeats={args.repeats}")
    print(f"{'case':26s} " + " ".join(f"{name:>19s}" for name in methods) + "   (GB/s of input read)")
    fresh = {}
    if "cpu" in devices:
        fresh = measure(methods, "cpu", args.size, args.repeats, " fresh pages")
        if not keep_freed_memory_mapped():
            print("(cannot keep freed memory mapped here: not glibc; the ratios below are as above)")
    warm = {}
    for device in devices:
        warm.update(measure(methods, device, args.size, args.repeats, ""))

    def geo(results: dict, ours: str, theirs: str) -> float:
        ratios = [gbps[ours] / gbps[theirs] for gbps in results.values()]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    result = {"nvfp4_vs_torchao": geo(warm, "ours_nvfp4", "torchao_nvfp4"),
              "mxfp4_vs_torchao": geo(warm, "ours_mxfp4", "torchao_mxfp4"),
              "nvfp4_vs_copy": geo(warm, "ours_nvfp4", "copy"),
              "eager_nvfp4_vs_copy": geo(warm, "eager_nvfp4", "copy")}
    if fresh:
        result["nvfp4_vs_copy_fresh_pages"] = geo(fresh, "ours_nvfp4", "copy")
        result["eager_nvfp4_vs_copy_fresh_pages"] = geo(fresh, "eager_nvfp4", "copy")
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
