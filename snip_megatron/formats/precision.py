"""The precisions a planned linear layer can run in, and the named recipes that realise FP8 and FP4."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

FP8_RECIPES = ("blockwise", "tensorwise", "mxfp8")
"""FP8 recipes: blockwise (1x128 / 128x128 tiles, DeepSeek-V3), tensorwise (current scaling), mxfp8."""
FP4_RECIPES = ("nvfp4", "mxfp4")
"""FP4 recipes: nvfp4 (E4M3 scale per 16 values on an FP32 tensor scale), mxfp4 (E8M0 per 32)."""


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


@dataclass(frozen=True, kw_only=True)
class Formats:
    """The FP8 and FP4 formats of one run: what SNIP measures, what the emulated linears compute
    and what Transformer Engine is told to run. Built once (SnipConfig.formats) and passed on."""

    fp8_recipe: str = "blockwise"
    """FP8 recipe (FP8_RECIPES)."""
    fp4_recipe: str = "nvfp4"
    """FP4 recipe (FP4_RECIPES)."""

    def __post_init__(self) -> None:
        for name, valid in (("fp8_recipe", FP8_RECIPES), ("fp4_recipe", FP4_RECIPES)):
            value = getattr(self, name)
            if value not in valid:
                raise ValueError(f"Formats.{name}={value!r} is not valid; choose one of: {', '.join(valid)}")

    def recipe(self, precision: "Precision | str") -> str:
        """The recipe name of `precision` ("bf16" for BF16)."""
        p = Precision.parse(precision)
        return {Precision.BF16: "bf16", Precision.FP8: self.fp8_recipe, Precision.FP4: self.fp4_recipe}[p]

    def spec(self, precision: "Precision | str"):
        """The FormatSpec (every GEMM operand's cast) of `precision` in these formats."""
        from snip_megatron.formats.spec import FormatSpec

        return FormatSpec.for_precision(precision, fp8_recipe=self.fp8_recipe, fp4_recipe=self.fp4_recipe)

    def short_str(self) -> str:
        return f"fp8={self.fp8_recipe} fp4={self.fp4_recipe}"
