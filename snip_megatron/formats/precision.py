"""The precisions a planned linear layer can run in."""

from __future__ import annotations

from enum import Enum


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
