"""The formats of one run (`Formats`): which recipe and variants realise FP8 and FP4, and the
FormatSpec each precision then has. The precisions and the recipe names are recipes.py's (also
importable from here, where the rest of the package reads them)."""

from __future__ import annotations

from dataclasses import dataclass

from snip_megatron.formats.recipes import (
    FP4_GRADIENT_ROUNDINGS, FP4_RECIPES, FP8_BLOCK_SCALES, FP8_FORMATS, FP8_RECIPES, Precision, check_variants,
    effective_fp4_gradient_rounding, effective_fp8_format,
)
from snip_megatron.formats.spec import FormatSpec

__all__ = ["FP4_GRADIENT_ROUNDINGS", "FP4_RECIPES", "FP8_BLOCK_SCALES", "FP8_FORMATS", "FP8_RECIPES", "Formats",
           "Precision"]


@dataclass(frozen=True, kw_only=True)
class Formats:
    """The FP8 and FP4 formats of one run: what SNIP measures, what the emulated linears compute
    and what Transformer Engine is told to run. Built once (SnipConfig.formats) and passed on."""

    fp8_recipe: str = "blockwise"
    """FP8 recipe (FP8_RECIPES)."""
    fp4_recipe: str = "nvfp4"
    """FP4 recipe (FP4_RECIPES)."""
    fp8_format: "str | None" = None
    """FP8 element formats (FP8_FORMATS): e4m3 everywhere, or hybrid (E5M2 gradients); None: the
    recipe's own (blockwise and mxfp8: e4m3, tensorwise: hybrid). mxfp8 takes e4m3 only."""
    fp8_block_scales: str = "fp32"
    """Blockwise FP8 block scales (FP8_BLOCK_SCALES): fp32 (max / amax) or pow2 (that rounded down
    to a power of two, TE's default). Only the blockwise recipe takes pow2."""
    fp4_gradient_rounding: "str | None" = None
    """Rounding of FP4 gradients (FP4_GRADIENT_ROUNDINGS); None: the recipe's own (nvfp4:
    stochastic, mxfp4: nearest). mxfp4 takes nearest only."""

    def __post_init__(self) -> None:
        check_variants(fp8_recipe=self.fp8_recipe, fp4_recipe=self.fp4_recipe, fp8_format=self.fp8_format,
                       fp8_block_scales=self.fp8_block_scales,
                       fp4_gradient_rounding=self.fp4_gradient_rounding)

    @property
    def effective_fp8_format(self) -> str:
        """`fp8_format`, or the FP8 recipe's own when it is None."""
        return effective_fp8_format(self.fp8_recipe, self.fp8_format)

    @property
    def effective_fp4_gradient_rounding(self) -> str:
        """`fp4_gradient_rounding`, or the FP4 recipe's own when it is None."""
        return effective_fp4_gradient_rounding(self.fp4_recipe, self.fp4_gradient_rounding)

    def recipe(self, precision: "Precision | str") -> str:
        """The recipe name of `precision` ("bf16" for BF16)."""
        p = Precision.parse(precision)
        return {Precision.BF16: "bf16", Precision.FP8: self.fp8_recipe, Precision.FP4: self.fp4_recipe}[p]

    def spec(self, precision: "Precision | str"):
        """The FormatSpec (every GEMM operand's cast) of `precision` in these formats."""
        return FormatSpec.for_precision(precision, fp8_recipe=self.fp8_recipe, fp4_recipe=self.fp4_recipe,
                                        fp8_format=self.fp8_format, fp8_block_scales=self.fp8_block_scales,
                                        fp4_gradient_rounding=self.fp4_gradient_rounding)

    def describe(self, precision: "Precision | str") -> str:
        """The recipe of `precision` with what sets it apart, e.g. "blockwise (e4m3, pow2 scales)"."""
        p = Precision.parse(precision)
        if p is Precision.FP8:
            parts = [self.effective_fp8_format]
            if self.fp8_recipe == "blockwise":
                parts.append(f"{self.fp8_block_scales} scales")
            return f"{self.fp8_recipe} ({', '.join(parts)})"
        if p is Precision.FP4:
            return f"{self.fp4_recipe} ({self.effective_fp4_gradient_rounding} gradient rounding)"
        return "bf16"

    def short_str(self, uses=("fp8", "fp4")) -> str:
        """E.g. "fp8=blockwise fp4=nvfp4"; variants set apart from the recipes' defaults follow in
        parentheses ("fp8=blockwise(pow2) fp4=nvfp4(nearest)"); only the precisions in `uses`."""
        uses = {Precision.parse(p) for p in uses}
        fp8 = [v for v, default in ((self.fp8_format, None), (self.fp8_block_scales, "fp32")) if v != default]
        fp4 = [self.fp4_gradient_rounding] if self.fp4_gradient_rounding is not None else []
        parts = []
        if Precision.FP8 in uses:
            parts.append(f"fp8={self.fp8_recipe}{'(' + ','.join(fp8) + ')' if fp8 else ''}")
        if Precision.FP4 in uses:
            parts.append(f"fp4={self.fp4_recipe}{'(' + ','.join(fp4) + ')' if fp4 else ''}")
        return " ".join(parts) or "none (BF16 only)"

    def to_dict(self) -> dict:
        """Plain JSON-ready values (what a quant_recipe config dict carries)."""
        return {"fp8_recipe": self.fp8_recipe, "fp4_recipe": self.fp4_recipe, "fp8_format": self.fp8_format,
                "fp8_block_scales": self.fp8_block_scales, "fp4_gradient_rounding": self.fp4_gradient_rounding}
