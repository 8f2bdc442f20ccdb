"""The environment switches Transformer Engine 2.14 reads when `transformer_engine.common.recipe`
is imported: they fix the numerics of the recipes Megatron builds per module (it passes no
options but the FP8 element format), so the formats SNIP measures must follow them.

Each is TE's own rule, `os.getenv(NAME, "0") == "1"`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

FP8_BLOCK_FP32_SCALES = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
FP8_CURRENT_POW2_SCALES = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"
NVFP4_DISABLE_RHT = "NVTE_NVFP4_DISABLE_RHT"
NVFP4_DISABLE_SR = "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"
NVFP4_DISABLE_2D = "NVTE_NVFP4_DISABLE_2D_QUANTIZATION"


@dataclass(frozen=True)
class TESwitches:
    """TE's import-time recipe switches, as TE reads them."""

    fp8_block_fp32_scales: bool
    """Float8BlockScaling with FP32 scales (default: power-of-two scales)."""
    fp8_current_pow2_scales: bool
    """Float8CurrentScaling with power-of-two scales (default: FP32)."""
    nvfp4_disable_rht: bool
    """NVFP4BlockScaling without the random Hadamard transform on the wgrad operands."""
    nvfp4_disable_stochastic_rounding: bool
    """NVFP4BlockScaling rounding gradients to nearest."""
    nvfp4_disable_2d: bool
    """NVFP4BlockScaling with 1x16 weight blocks instead of 16x16 tiles."""

    @classmethod
    def read(cls, environ: "Mapping[str, str] | None" = None) -> "TESwitches":
        env = os.environ if environ is None else environ

        def on(name: str) -> bool:
            return env.get(name, "0") == "1"

        return cls(fp8_block_fp32_scales=on(FP8_BLOCK_FP32_SCALES),
                   fp8_current_pow2_scales=on(FP8_CURRENT_POW2_SCALES),
                   nvfp4_disable_rht=on(NVFP4_DISABLE_RHT),
                   nvfp4_disable_stochastic_rounding=on(NVFP4_DISABLE_SR),
                   nvfp4_disable_2d=on(NVFP4_DISABLE_2D))

    @property
    def fp8_block_scales(self) -> str:
        """The blockwise scale format TE runs: "fp32" or "pow2"."""
        return "fp32" if self.fp8_block_fp32_scales else "pow2"
