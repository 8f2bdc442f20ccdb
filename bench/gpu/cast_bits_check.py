"""Every cast SNIP emulates, run on a device against the CPU reference, bit for bit: the dequantized
values, the element codes, the block and tensor scales, the GEMM operands of the tensor-core path
and the stochastic-rounding noise. SNIP's core claim is "exact emulation on any device"; a
difference here invalidates every FP8/FP4 study on that device, so this runs first.

    python bench/gpu/cast_bits_check.py                  # CUDA
    python bench/gpu/cast_bits_check.py --device cpu     # the fused path against the reference on CPU

What it compares, per recipe variant (FP8 blockwise with FP32 and pow2 scales, HYBRID E5M2
gradients, tensorwise, MXFP8; NVFP4 with stochastic and with nearest gradient rounding, MXFP4) and
per GEMM role (6), on three probes (BF16 with E2M1 rounding ties, a zero block and an outlier; FP32
over 60 decades with subnormals; FP32 with Inf and NaN), with counter-based noise from one seed:
- `quantize` (the fused path) and `quantize_reference`, both on the device, against
  `quantize_reference` on the CPU: dequantized bits (NaN where NaN), codes and scales (finite
  probes: a NaN group's codes and scales are the platform's NaN arithmetic);
- `quantize_operand` on the device against the CPU: values, block scales and tensor scale;
- the noise itself, `CounterNoise.uniform`, device against CPU, for each probe's shape.
One line per difference (`DIFF <variant> <role> <probe> <what>`), then
`RESULT device=<d> checks=<n> diffs=<n> ok=<0|1>`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from snip_megatron.formats import Formats, Role, quantize, quantize_reference  # noqa: E402
from snip_megatron.formats.compiled import same_bits  # noqa: E402
from snip_megatron.formats.operand import quantize_operand  # noqa: E402
from snip_megatron.formats.sr_noise import CounterNoise  # noqa: E402

VARIANTS = {
    "blockwise": ("fp8", Formats()), "blockwise_pow2": ("fp8", Formats(fp8_block_scales="pow2")),
    "blockwise_hybrid": ("fp8", Formats(fp8_format="hybrid")),
    "tensorwise": ("fp8", Formats(fp8_recipe="tensorwise")), "mxfp8": ("fp8", Formats(fp8_recipe="mxfp8")),
    "nvfp4": ("fp4", Formats()), "nvfp4_nearest": ("fp4", Formats(fp4_gradient_rounding="nearest")),
    "mxfp4": ("fp4", Formats(fp4_recipe="mxfp4")),
}
SEED = 0x1234567890ABCDEF
"""The stochastic-rounding noise seed (64 bits: the int32 wrap of the counter hash is exercised)."""


def probes(rows: int = 272, cols: int = 528) -> dict[str, torch.Tensor]:
    """CPU tensors whose dims are not whole 128 (or 32) blocks: BF16 with E2M1 ties, a zero block and
    an outlier; FP32 over 60 decades with subnormals; FP32 with Inf and NaN."""
    g = torch.Generator().manual_seed(3)
    bf16 = torch.randn(rows, cols, generator=g)
    bf16[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    bf16[1, :128] = 0.0
    bf16[2, 5] = 3e4
    wide = torch.randn(rows, cols, generator=g) * torch.logspace(-40, 20, cols)
    special = torch.randn(rows, cols, generator=g)
    special[3, 7], special[100, 300], special[200, 17] = float("nan"), float("inf"), -float("inf")
    return {"bf16": bf16.bfloat16(), "fp32_wide": wide, "fp32_special": special}


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return same_bits(a, b) if a.is_floating_point() else torch.equal(a, b)


def check(device: torch.device, log=print) -> tuple[int, list[str]]:
    """(checks made, one line per difference)."""
    n, diffs = 0, []

    def compare(what: str, got, ref) -> None:
        nonlocal n
        n += 1
        if not _same(got, ref):
            diffs.append(f"DIFF {what}")
            log(f"DIFF {what}")

    data = probes()
    for probe, x in data.items():
        compare(f"noise - {probe} counter noise", CounterNoise(SEED).uniform(x.shape, device),
                CounterNoise(SEED).uniform(x.shape, "cpu"))
    for name, (precision, formats) in VARIANTS.items():
        spec = formats.spec(precision)
        for role in Role:
            cast, dim = spec.cast(role), role.contraction_dim
            for probe, x in data.items():
                kw = dict(dim=dim, noise=CounterNoise(SEED))
                ref = quantize_reference(x, cast, out_dtype=torch.float32, return_codes=True, **kw)
                finite = probe != "fp32_special"
                for path, fn in (("fused", quantize), ("reference", quantize_reference)):
                    got = fn(x.to(device), cast, out_dtype=torch.float32, return_codes=True, **kw)
                    where = f"{name} {role.value} {probe} {path}"
                    compare(f"{where} values", got.dequantized.contiguous(), ref.dequantized.contiguous())
                    if finite:
                        compare(f"{where} codes", got.codes, ref.codes)
                        compare(f"{where} scales", got.scales, ref.scales)
                        compare(f"{where} tensor scale", got.tensor_scale, ref.tensor_scale)
                op_ref = quantize_operand(x, cast, **kw)
                op = quantize_operand(x.to(device), cast, **kw)
                where = f"{name} {role.value} {probe} operand"
                compare(f"{where} values", op.values.contiguous(), op_ref.values.contiguous())
                compare(f"{where} block scales", op.block_scales, op_ref.block_scales)
                compare(f"{where} tensor scale", op.tensor_scale, op_ref.tensor_scale)
    return n, diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu")
    device = torch.device(args.device)
    start = time.perf_counter()
    n, diffs = check(device)
    print(f"{n} checks on {args.device} against the CPU reference: {len(diffs)} differences "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"RESULT device={args.device} checks={n} diffs={len(diffs)} ok={int(not diffs)}", flush=True)
    return 0 if not diffs else 1


if __name__ == "__main__":
    sys.exit(main())
