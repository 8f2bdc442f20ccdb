"""The precisions a planned linear layer can run in, and the names of the recipes (and their
variants) that realise FP8 and FP4. Names only: the casts each recipe makes are spec.py's
(`FormatSpec.for_precision`), the run's choice among them precision.py's (`Formats`)."""

from __future__ import annotations

from enum import Enum

FP8_RECIPES = ("blockwise", "tensorwise", "mxfp8")
"""FP8 recipes: blockwise (1x128 / 128x128 tiles, DeepSeek-V3), tensorwise (current scaling), mxfp8."""
FP4_RECIPES = ("nvfp4", "mxfp4")
"""FP4 recipes: nvfp4 (E4M3 scale per 16 values on an FP32 tensor scale), mxfp4 (E8M0 per 32)."""
FP8_FORMATS = ("e4m3", "hybrid")
"""FP8 element formats, as Transformer Engine names them: e4m3 for every operand, or hybrid (E4M3
inputs and weights, E5M2 gradients)."""
FP8_BLOCK_SCALES = ("fp32", "pow2")
"""Scales of a blockwise FP8 block: any float32 (max / amax), or that rounded down to a power of two
(TE Float8BlockScaling's default, force_pow_2_scales)."""
FP4_GRADIENT_ROUNDINGS = ("stochastic", "nearest")
"""Rounding of FP4 gradients: stochastic (unbiased) or round-to-nearest-even."""

# The element formats and gradient rounding each recipe has when none is asked for.
_DEFAULT_FP8_FORMAT = {"blockwise": "e4m3", "tensorwise": "hybrid", "mxfp8": "e4m3"}
_DEFAULT_FP4_GRADIENT_ROUNDING = {"nvfp4": "stochastic", "mxfp4": "nearest"}


def effective_fp8_format(fp8_recipe: str, fp8_format: "str | None") -> str:
    """`fp8_format`, or the FP8 recipe's own when it is None."""
    return fp8_format or _DEFAULT_FP8_FORMAT[fp8_recipe]


def effective_fp4_gradient_rounding(fp4_recipe: str, fp4_gradient_rounding: "str | None") -> str:
    """`fp4_gradient_rounding`, or the FP4 recipe's own when it is None."""
    return fp4_gradient_rounding or _DEFAULT_FP4_GRADIENT_ROUNDING[fp4_recipe]


class Precision(str, Enum):
    """One precision per linear layer; the value is the name used in plans, configs and CLIs."""

    BF16 = "bf16"
    FP8 = "fp8"
    FP4 = "fp4"

    @classmethod
    def parse(cls, name: "str | Precision") -> "Precision":
        """`Precision.parse("FP4") -> Precision.FP4`; unknown names raise ValueError listing valid ones."""
        if isinstance(name, Precision):
            return name
        try:
            return cls(str(name).strip().lower())
        except ValueError:
            valid = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown precision {name!r}; valid precisions: {valid}") from None

    def __str__(self) -> str:  # so f-strings and logs print "fp4", not "Precision.FP4"
        return self.value


def check_variants(*, fp8_recipe: str, fp4_recipe: str, fp8_format: "str | None",
                   fp8_block_scales: str, fp4_gradient_rounding: "str | None",
                   owner: str = "Formats") -> None:
    """Raise ValueError naming the field unless every name is known and the combination is one our
    quantizers emulate exactly."""
    for name, value, valid in (("fp8_recipe", fp8_recipe, FP8_RECIPES), ("fp4_recipe", fp4_recipe, FP4_RECIPES),
                               ("fp8_block_scales", fp8_block_scales, FP8_BLOCK_SCALES)):
        if value not in valid:
            raise ValueError(f"{owner}.{name}={value!r} is not valid; choose one of: {', '.join(valid)}")
    for name, value, valid in (("fp8_format", fp8_format, FP8_FORMATS),
                               ("fp4_gradient_rounding", fp4_gradient_rounding, FP4_GRADIENT_ROUNDINGS)):
        if value is not None and value not in valid:
            raise ValueError(f"{owner}.{name}={value!r} is not valid; choose one of: {', '.join(valid)} "
                             "(or leave it unset for the recipe's own)")
    if fp8_recipe == "mxfp8" and fp8_format == "hybrid":
        raise ValueError(f"{owner}.fp8_format='hybrid' with fp8_recipe='mxfp8': MXFP8 with E5M2 gradients "
                         "is not emulated; use fp8_format='e4m3' (MXFP8's own)")
    if fp8_block_scales == "pow2" and fp8_recipe != "blockwise":
        raise ValueError(f"{owner}.fp8_block_scales='pow2' is the blockwise recipe's (TE Float8BlockScaling); "
                         f"fp8_recipe={fp8_recipe!r} has {'E8M0' if fp8_recipe == 'mxfp8' else 'FP32'} scales: "
                         "leave fp8_block_scales at 'fp32'")
    if fp4_recipe == "mxfp4" and fp4_gradient_rounding == "stochastic":
        raise ValueError(f"{owner}.fp4_gradient_rounding='stochastic' with fp4_recipe='mxfp4': MXFP4 "
                         "rounds to nearest here; use 'nearest' or fp4_recipe='nvfp4'")
