"""What each GPU generation runs through Transformer Engine, by compute capability (SM).

Facts from TE 2.14's `pytorch/quantization.py` support checks and kernels:
- FP8 tensorwise (Float8CurrentScaling) needs SM89+; blockwise (Float8BlockScaling) SM90+ (and
  CUDA 12.9); on SM100+ blockwise is emulated with MXFP8 GEMMs, which need power-of-two scales;
  MXFP8 needs SM100+ and is not supported on SM120+.
- NVFP4 kernels need SM100+. Before that TE has FP4 only as a Python reference quantizer for its
  own tests (`custom_recipes`), which SNIP does not use: under Megatron's fused weight-gradient
  accumulation its GEMM drops the FP4 weight gradients, its cached weight is emptied when saved
  for backward (pipeline warm-up fails), it runs hundreds of times slower than BF16, and its module
  moved between TE releases. So SNIP's TE backend plans BF16/FP8 before SM100; FP4 studies there
  run on SNIP's emulated linears (`--transformer-impl local`), which compute what SNIP measures.
- MXFP4 has no TE recipe.

The table is what a GPU generation can run; the installed TE's own answers (its version, CUDA and
cuBLAS checks: `snip_megatron.te.installed.TESupport`) are asked too where TE is installed.
Pure Python: the capability is a parameter everywhere; `current_sm()` reads this process's GPU.
"""

from __future__ import annotations

from snip_megatron.formats.precision import Precision

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


def fp8_unavailable(recipe: str, sm: int, support=None) -> "str | None":
    """Why TE cannot run FP8 `recipe` on SM`sm`, or None when it can. `support`: the installed TE's
    answers (TESupport), asked after the table."""
    check_sm(sm)
    if sm < 89:
        return f"{generation(sm)} has no FP8 tensor cores (TE needs SM89+)"
    if recipe == "blockwise" and sm < 90:
        return f"TE's blockwise FP8 needs SM90+, this GPU is {generation(sm)}"
    if recipe == "mxfp8" and not 100 <= sm < 120:
        return f"TE's MXFP8 needs SM100-SM119 (Blackwell data-centre GPUs), this GPU is {generation(sm)}"
    return None if support is None else support.recipe_unavailable(recipe)


def fp4_unavailable(recipe: str, sm: int, support=None) -> "str | None":
    """Why TE cannot run FP4 `recipe` on SM`sm` for SNIP, or None when it runs it on its NVFP4
    kernels. `support`: the installed TE's answers (TESupport), asked after the table."""
    check_sm(sm)
    if recipe != "nvfp4":
        return (f"fp4_recipe={recipe!r} has no Transformer Engine recipe (TE runs NVFP4 only; MXFP4 runs "
                "in SNIP's emulated linears)")
    if sm < 100:
        return (f"TE's NVFP4 kernels need SM100+ (Blackwell), this GPU is {generation(sm)}; before SM100 "
                "SNIP's TE backend plans BF16 and FP8 (TE's Python reference FP4 quantizer drops FP4 weight "
                "gradients under fused wgrad accumulation, fails under pipeline warm-up and runs about "
                "100x slower than BF16)")
    return None if support is None else support.recipe_unavailable(recipe)


def gemm_cost(sm: int) -> dict[Precision, float]:
    """Relative GEMM time per precision on SM`sm` for the planner's speed-up model: FP8 tensor cores
    run at 2x BF16 (SM89+), NVFP4 kernels at 2x FP8 (SM100+). Before SM100 FP4 is never planned on
    TE (`fp4_unavailable`); its entry there, no faster than BF16, only completes the table."""
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
