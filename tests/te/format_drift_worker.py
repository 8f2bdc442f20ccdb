"""Would the TE double catch a SNIP format that differs from TE's? One process, TP=1.

    PYTHONPATH=<repo>:<repo>/tests/apex_double:<repo>/tests/te_double SNIP_CPU_KERNEL=0 \
        python tests/te/format_drift_worker.py --out FILE

Builds Megatron's GPT model with its TE layer spec over the double and SNIP's plan (worker.plan():
blockwise FP8 with power-of-two scales and NVFP4 with stochastic gradients on SM100), then, for
one planned linear of each format, compares what Megatron's TE wrapper computes over the double
(Y, dX, dW through main_grad) with SNIP's quantized_linear for the formats SNIP measures
(megatron_checks._reference), first as SNIP is, then with SNIP's emulation changed in one rule
at a time (monkeypatched in this process only; SNIP_CPU_KERNEL=0 so the Python rules run):

    nvfp4_weight_tiles_1x16       FP4 weights in 1x16 tiles instead of TE's 16x16 blocks
    pow2_scales_rounded_up        blockwise FP8 scales rounded up to a power of two, not down
    hadamard_signs_seeded         SNIP's own seeded RHT signs (its rule before it took TE's)
    scale_as_reciprocal_times_max current-scaling FP8 (a second model planned tensorwise): the
                                  scale as (1 / amax) * max, SNIP's arithmetic before it divided
                                  as TE does

Writes {variant: {"<layer>.<linear>": {"label", "y", "dx", "dw"}}} with each output's agreement
(snip_vs_double.agree: bit for bit, NVFP4 within a few ulps). test_double_is_not_snip.py
asserts the pattern.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import megatron_checks as checks  # noqa: E402
from snip_vs_double import agree  # noqa: E402
from tests.te import te_worker as worker  # noqa: E402

CHOSEN = ("1.linear_qkv", "1.linear_proj")
"""The planned linears compared: blockwise FP8 (TELayerNormColumnParallelLinear) and NVFP4
(TERowParallelLinear), worker.PLAN_TABLE."""


def compare(model, keys) -> dict:
    """{key: {label, y, dx, dw}}: whether each output of the model's planned linear agrees with
    SNIP's emulation of its planned format."""
    linears = worker.planned_linears(model)
    g = torch.Generator().manual_seed(5)
    out = {}
    for key in keys:
        module = linears[key]
        x, gy, state, got, _ = checks._forward_backward(module, g)
        fmt = module.last_run.label
        want = checks._reference(module, x, gy, fmt, state)
        out[key] = {"label": fmt, **{name: agree(a, b, fmt) for name, a, b in zip(("y", "dx", "dw"), got, want)}}
    return out


@contextlib.contextmanager
def patched(target, name: str, value):
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


@contextlib.contextmanager
def nvfp4_weight_tiles_1x16():
    from snip_megatron.formats import spec

    original = spec._FP4_RECIPES["nvfp4"]

    def nvfp4(*, stochastic: bool) -> dict:
        roles = original(stochastic=stochastic)
        weight = dataclasses.replace(roles["fprop_weight"], block=(1, 16))
        return {**roles, "fprop_weight": weight, "dgrad_weight": weight}

    with patched(spec, "_FP4_RECIPES", {**spec._FP4_RECIPES, "nvfp4": nvfp4}):
        yield


@contextlib.contextmanager
def fp32_encode_scale_replaced(replacement):
    """SNIP's FP32 / pow2 scale rule (formats/scales.py, which the eager casts call; quantize.py
    holds its own name for it) replaced by `replacement(amax, elem_max)`. The module is taken from
    sys.modules: the package re-exports a function of the same name, `formats.quantize`."""
    import importlib

    quantize = importlib.import_module("snip_megatron.formats.quantize")
    scales = importlib.import_module("snip_megatron.formats.scales")

    with patched(scales, "fp32_encode_scale", replacement), \
            patched(quantize, "fp32_encode_scale", replacement):
        yield


@contextlib.contextmanager
def pow2_scales_rounded_up():
    from snip_megatron.formats import scales

    original = scales.fp32_encode_scale

    def rounded_up(amax, elem_max):  # the mask then keeps the next power of two up (or saturates)
        return original(amax, elem_max) * (2 - 2.0**-22)

    with fp32_encode_scale_replaced(rounded_up):
        yield


@contextlib.contextmanager
def hadamard_signs_seeded():
    from snip_megatron.formats import hadamard

    def seeded(size: int) -> torch.Tensor:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < size:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        gen = torch.Generator().manual_seed(hadamard.HADAMARD_SIGN_SEED)
        signs = torch.randint(0, 2, (size,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
        return h * signs / size ** 0.5

    hadamard._SIGN_CACHE.clear()
    try:
        with patched(hadamard, "_matrix_cpu", seeded):
            yield
    finally:
        hadamard._SIGN_CACHE.clear()


@contextlib.contextmanager
def scale_as_reciprocal_times_max():
    def reciprocal_times_max(amax, elem_max):
        scale = amax.reciprocal() * elem_max
        scale = torch.where(amax == 0, torch.ones_like(scale), scale)
        return scale.clamp(max=torch.finfo(torch.float32).max)

    with fp32_encode_scale_replaced(reciprocal_times_max):
        yield


def tensorwise_formats(sm: int = 100):
    return dataclasses.replace(ORIGINAL_FORMATS_ON(sm), fp8_recipe="tensorwise", fp8_block_scales="fp32")


ORIGINAL_FORMATS_ON = worker.formats_on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if os.environ.get("SNIP_CPU_KERNEL") != "0":
        raise RuntimeError("run with SNIP_CPU_KERNEL=0: the patched rules are SNIP's Python ones")
    checks.setup()  # the double, SNIP's stochastic-rounding draws, TP=1
    from snip_megatron.megatron import runtime

    runtime.seed_all(worker.SEED)
    model = worker.build_te_gpt(the_plan=worker.plan())
    report = {"snip_as_is": compare(model, CHOSEN)}
    for variant in (nvfp4_weight_tiles_1x16, pow2_scales_rounded_up, hadamard_signs_seeded):
        with variant():
            report[variant.__name__] = compare(model, CHOSEN)
    with patched(worker, "formats_on", tensorwise_formats):
        runtime.seed_all(worker.SEED)
        tensorwise = worker.build_te_gpt(the_plan=worker.plan())
        report["tensorwise_as_is"] = compare(tensorwise, CHOSEN[:1])
        with scale_as_reciprocal_times_max():
            report["scale_as_reciprocal_times_max"] = compare(tensorwise, CHOSEN[:1])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
