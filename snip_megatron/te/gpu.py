"""What each GPU generation runs through Transformer Engine 2.14, by compute capability (SM).

Facts from TE 2.14's `pytorch/quantization.py` support checks and kernels:
- FP8 tensorwise (Float8CurrentScaling) needs SM89+; blockwise (Float8BlockScaling) SM90+ (and
  CUDA 12.9); on SM100+ blockwise is emulated with MXFP8 GEMMs, which need power-of-two scales;
  MXFP8 needs SM100+ and is not supported on SM120+.
- NVFP4 kernels need SM100+. Before that, TE's own tests run NVFP4 on SM89+ through a CustomRecipe
  with its Python reference quantizer (`REFERENCE_NVFP4_FACTORY`): fake-quantized numerics at TE's
  structure, GEMMs in high precision, no speed-up. Its NVFP4 rounds gradients to nearest.
- MXFP4 has no TE recipe; the reference quantizer's power-of-two path does not run in 2.14.

Pure Python: the capability is a parameter everywhere; `current_sm()` reads this process's GPU.
"""

from __future__ import annotations

from snip_megatron.formats.precision import Precision

REFERENCE_NVFP4_FACTORY = ("transformer_engine.pytorch.custom_recipes.quantization_nvfp4."
                           "nvfp4_ref_rht_2d_quantizer_factory")
"""TE's Python NVFP4 quantizer factory (RHT on the wgrad operands, 16x16 weight tiles), the path
Megatron's `TEQuantizationRecipe.custom_recipe_factory` resolves with `_get_custom_recipe`."""

_GENERATIONS = ((120, "Blackwell (RTX)"), (100, "Blackwell"), (90, "Hopper"), (89, "Ada"), (80, "Ampere"))


def check_sm(sm) -> int:
    """`sm` as an int (major*10+minor), or ValueError."""
    if not isinstance(sm, int) or isinstance(sm, bool) or sm < 10:
        raise ValueError(f"compute capability must be an int like 90 (H100) or 100 (B200), got {sm!r}")
    return sm


def generation(sm: int) -> str:
    """E.g. "SM90 (Hopper)"."""
    check_sm(sm)
    name = next((n for low, n in _GENERATIONS if sm >= low), "pre-Ampere")
    return f"SM{sm} ({name})"


def fp8_unavailable(recipe: str, sm: int) -> "str | None":
    """Why TE cannot run FP8 `recipe` on SM`sm`, or None when it can."""
    check_sm(sm)
    if sm < 89:
        return f"{generation(sm)} has no FP8 tensor cores (TE needs SM89+)"
    if recipe == "blockwise" and sm < 90:
        return f"TE's blockwise FP8 needs SM90+, this GPU is {generation(sm)}"
    if recipe == "mxfp8" and not 100 <= sm < 120:
        return f"TE's MXFP8 needs SM100-SM119 (Blackwell data-centre GPUs), this GPU is {generation(sm)}"
    return None


def fp4_route(recipe: str, sm: int) -> str:
    """How TE runs FP4 `recipe` on SM`sm`: "native" (NVFP4 kernels) or "reference" (a CustomRecipe
    with TE's Python reference quantizer); ValueError with the fix when it cannot."""
    check_sm(sm)
    if recipe != "nvfp4":
        raise ValueError(f"fp4_recipe={recipe!r} has no Transformer Engine recipe (TE 2.14 runs NVFP4 "
                         "only; its reference quantizer's power-of-two (MXFP4) path does not run)")
    if sm >= 100:
        return "native"
    if sm >= 89:
        return "reference"
    raise ValueError(f"FP4 through TE needs SM89+ (the reference quantizer, as TE's own tests run it) "
                     f"or SM100+ (NVFP4 kernels), this GPU is {generation(sm)}")


def gemm_cost(sm: int) -> dict[Precision, float]:
    """Relative GEMM time per precision on SM`sm` for the planner's speed-up model: FP8 tensor cores
    run at 2x BF16 (SM89+), NVFP4 kernels at 2x FP8 (SM100+); FP4 through the reference quantizer
    computes its GEMMs in high precision after a Python quantizer, so it is no faster than BF16."""
    check_sm(sm)
    fp8 = 0.5 if sm >= 89 else 1.0
    fp4 = 0.25 if sm >= 100 else 1.0
    return {Precision.BF16: 1.0, Precision.FP8: fp8, Precision.FP4: fp4}


def current_sm() -> int:
    """Compute capability of this process's CUDA device as major*10+minor (90 for H100). Tests on
    CPU monkeypatch this function (the one place the GPU generation is read)."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("the TE backend needs a CUDA GPU to read its compute capability (or pass "
                         "sm=<compute capability>)")
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor
