"""What a plan's precisions mean on Transformer Engine: recipe names per precision, by GPU."""

from __future__ import annotations

from dataclasses import dataclass

from snip_megatron.formats.precision import FP8_RECIPES

# FP4 recipes Transformer Engine runs natively (per module, through Megatron's TEQuantizationRecipe);
# every FP8 recipe of snip_megatron.formats is one TE runs too.
TE_FP4_RECIPES = ("nvfp4",)
# What to do with an FP4 layer on a GPU without native FP4 (before Blackwell).
FP4_FALLBACKS = ("emulated", "error")

# Per-module precision needs each layer's recipe chosen on every forward; these cannot do that.
_REFUSED_FP8 = {
    "delayed": "delayed scaling keeps an amax history per module across steps and Megatron's "
               "per-module TE config rejects it; use 'tensorwise', 'blockwise' or 'mxfp8'",
    "custom": "custom recipes are not translated by SNIP; use 'tensorwise', 'blockwise' or 'mxfp8'",
}


@dataclass(frozen=True, kw_only=True)
class TEOptions:
    """How FP8/FP4 are run through Transformer Engine."""

    fp8_recipe: str | None = None
    """FP8 recipe: 'blockwise' (SM90 default, 1x128/128x128 blocks, DeepSeek-V3), 'mxfp8'
    (SM100+ default), 'tensorwise' (current scaling). None picks by compute capability."""
    fp4_recipe: str = "nvfp4"
    """FP4 recipe on GPUs with native FP4 (SM100+)."""
    fp4_fallback: str = "emulated"
    """FP4 on GPUs without native FP4: 'emulated' (SNIP's emulated linear) or 'error'."""
    fp8_format: str = "e4m3"
    """TE FP8 format: 'e4m3' everywhere, or 'hybrid' (E5M2 gradients)."""
    tp_only_amax_red: bool = False
    """Reduce per-tensor amaxes over TP only (tensorwise recipe)."""

    def __post_init__(self) -> None:
        if self.fp8_recipe is not None:
            if self.fp8_recipe in _REFUSED_FP8:
                raise ValueError(f"TEOptions.fp8_recipe={self.fp8_recipe!r} cannot switch per "
                                 f"layer: {_REFUSED_FP8[self.fp8_recipe]}")
            if self.fp8_recipe not in FP8_RECIPES:
                raise ValueError(f"TEOptions.fp8_recipe={self.fp8_recipe!r} is unknown; valid: "
                                 f"{', '.join(FP8_RECIPES)} (or None to pick by GPU)")
        if self.fp4_recipe not in TE_FP4_RECIPES:
            raise ValueError(f"TEOptions.fp4_recipe={self.fp4_recipe!r} has no Transformer Engine "
                             f"recipe; valid: {', '.join(TE_FP4_RECIPES)}")
        if self.fp4_fallback not in FP4_FALLBACKS:
            raise ValueError(f"TEOptions.fp4_fallback={self.fp4_fallback!r} is unknown; valid: "
                             f"{', '.join(FP4_FALLBACKS)}")
        if self.fp8_format not in ("e4m3", "hybrid"):
            raise ValueError(f"TEOptions.fp8_format={self.fp8_format!r} is unknown; valid: e4m3, hybrid")


def default_fp8_recipe(sm: int) -> str:
    """FP8 recipe by compute capability (major*10+minor): blockwise on Hopper, MXFP8 on Blackwell.

    Ada (SM89) has FP8 tensor cores but no blockwise kernels in TE, so it gets tensorwise.
    """
    _check_sm(sm)
    if sm >= 100:
        return "mxfp8"
    if sm >= 90:
        return "blockwise"
    if sm >= 89:
        return "tensorwise"
    raise ValueError(f"SM{sm} has no FP8 tensor cores (needs SM89+); run FP8 layers emulated")


def has_native_fp4(sm: int) -> bool:
    """NVFP4 GEMMs need Blackwell (SM100+)."""
    _check_sm(sm)
    return sm >= 100


def fp8_recipe_for(sm: int, options: TEOptions) -> str:
    """The FP8 recipe to run on SM`sm`: the configured one, checked against the hardware."""
    recipe = options.fp8_recipe or default_fp8_recipe(sm)
    if recipe == "mxfp8" and sm < 100:
        raise ValueError(f"fp8_recipe='mxfp8' needs SM100+ (Blackwell), this GPU is SM{sm}; "
                         f"use 'blockwise' or 'tensorwise'")
    if recipe == "blockwise" and sm < 90:
        raise ValueError(f"fp8_recipe='blockwise' needs SM90+, this GPU is SM{sm}; use 'tensorwise'")
    if sm < 89:
        raise ValueError(f"SM{sm} has no FP8 tensor cores (needs SM89+)")
    return recipe


def _check_sm(sm) -> None:
    if not isinstance(sm, int) or isinstance(sm, bool) or sm < 10:
        raise ValueError(f"compute capability must be an int like 90 (H100) or 100 (B200), got {sm!r}")
