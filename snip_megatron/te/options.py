"""TE settings that are not number formats (the formats are the run's one `Formats` value)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TEOptions:
    """How SNIP's per-module TE configs run, besides their formats."""

    tp_only_amax_red: bool = False
    """Reduce per-tensor amaxes over the TP group only, not TP x CP (Megatron's
    TEQuantizationRecipe.tp_only_amax_red; the tensorwise recipe reads it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.tp_only_amax_red, bool):
            raise ValueError(f"TEOptions.tp_only_amax_red must be True or False, got {self.tp_only_amax_red!r}")
