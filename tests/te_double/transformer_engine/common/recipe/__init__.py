"""Test double of `transformer_engine.common.recipe`: the recipe classes, laid out per TE version.

Field names, defaults, equality and the environment switches read at import follow TE's
`transformer_engine/common/recipe/__init__.py`; TE builds them with pydantic dataclasses, the double
with stdlib ones (same fields, same value equality; no pydantic type coercion).

The switches read at import, by the version the double stands in for
(`transformer_engine._double.VERSION`; file:line in TE's `common/recipe/__init__.py`):

    NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES  every version   v2.14:242  v2.16:300  v2.18:302  main:302
    NVTE_FP8_BLOCK_SCALING_FP32_SCALES       every version   v2.14:339  v2.16:417  v2.18:425  main:429
    NVTE_NVFP4_DISABLE_RHT                   every version   v2.14:441  v2.16:533  v2.18:554  main:558
    NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING   every version   v2.14:443  v2.16:535  v2.18:556  main:560
    NVTE_NVFP4_DISABLE_2D_QUANTIZATION       every version   v2.14:445  v2.16:537  v2.18:558  main:562
    NVTE_BACKWARD_OVERRIDE                   >= 2.15, every recipe class's `backward_override`
                                             v2.16:259,310,368,431,546,644  v2.18:261,312,370,439,570,680
                                             main:261,312,372,443,574,692; asserted None or one of
                                             'high_precision', 'dequantized' (DelayedScaling: None only)
    NVTE_NVFP4_ROW_SCALED_ACTIVATION         >= 2.16         v2.16:538  v2.18:559  main:563
    NVTE_NVFP4_4OVER6                        >= 2.17         v2.18:560  main:564  (scope, asserted)
    NVTE_NVFP4_4OVER6_E4M3_USE_256           >= 2.17         v2.18:561  main:565  (scope, asserted)
    NVTE_NVFP4_4OVER6_ERR_MODE               >= 2.17         v2.18:562  main:566  (upper-cased, asserted)

The double's linears run only the 2.14 variants: a recipe whose 2.15+ fields leave TE's default
(`unmodelled_switches`) is refused with NotImplementedError naming the field (as are the 2.14
variants SNIP's formats lack, `pytorch/module/_formats.py`). The C++ switches TE reads at each
quantize (NVTE_USE_FAST_MATH, NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH) have no recipe field and are not
modelled. SNIP's table of the same switches is `snip_megatron/te/environment.py`.

Two TE quirks are kept on purpose, because Megatron and our tests depend on them:
- `Float8BlockScaling` uses power-of-two block scales unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1
  was set when the module was imported; the per-operand `QParams` are class attributes computed
  from that switch, so `Float8BlockScaling(use_f32_scales=True)` alone does not change them.
- `Float8CurrentScaling` likewise reads NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES at import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, NamedTuple, Optional

from transformer_engine._double import version_tuple

_VERSION = version_tuple()
_BACKWARD_OVERRIDE = _VERSION >= (2, 15)
"""TE >= 2.15: every recipe class has `backward_override`, default NVTE_BACKWARD_OVERRIDE."""
_ROW_SCALED = _VERSION >= (2, 16)
"""TE >= 2.16: NVFP4BlockScaling.row_scaled_activation, default NVTE_NVFP4_ROW_SCALED_ACTIVATION."""
_FOUR_OVER_SIX = _VERSION >= (2, 17)
"""TE >= 2.17: NVFP4BlockScaling's 4over6 fields, defaults NVTE_NVFP4_4OVER6*."""
_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
_NVFP4_4OVER6_SCOPES = ("none", "weights", "activations", "all")
_NVFP4_4OVER6_ERR_MODES = ("MAE", "MSE")


class _FormatHelper(NamedTuple):
    max_fwd: float
    """Largest value of the forward-pass element format."""
    max_bwd: float
    """Largest value of the backward-pass (gradient) element format."""


class Format(Enum):
    """Element formats: E4M3 / E5M2 everywhere, HYBRID = E4M3 forward and E5M2 gradients, E2M1 FP4."""

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


@dataclass(frozen=True)
class MMParams:
    """GEMM options (cuBLAS fast accumulation); recorded, not modelled."""

    use_split_accumulator: bool = True


@dataclass(frozen=True)
class QParams:
    """Per-operand quantization options, as TE names them."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


class Recipe:
    """Base class; the class predicates are what TE's modules switch on."""

    @classmethod
    def nvfp4(cls):
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def mxfp8(cls):
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def delayed(cls):
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls):
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls):
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls):
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def custom(cls):
        return issubclass(cls, CustomRecipe)


def _no_pure_e5m2(recipe) -> None:
    if recipe.fp8_format == Format.E5M2:
        raise AssertionError("Pure E5M2 training is not supported.")  # TE asserts the same


def _check_backward_override(recipe) -> None:
    """TE >= 2.15's assert in every recipe's __post_init__ (v2.18 common/recipe/__init__.py:265-267, 316-318, ...)."""
    if getattr(recipe, "backward_override", None) not in _BACKWARD_OVERRIDES:
        raise AssertionError("NVTE_BACKWARD_OVERRIDE must be unset or one of: 'high_precision', 'dequantized'.")


def unmodelled_switches(recipe) -> list:
    """The fields of `recipe` TE >= 2.15 reads from its environment that leave TE's default, as
    "field=value" (the double's linears refuse them: they run the 2.14 recipes only)."""
    out = []
    if getattr(recipe, "backward_override", None) is not None:
        out.append(f"backward_override={recipe.backward_override!r}")
    if getattr(recipe, "row_scaled_activation", False):
        out.append("row_scaled_activation=True")
    if getattr(recipe, "nvfp4_4over6", "none") != "none":
        out.append(f"nvfp4_4over6={recipe.nvfp4_4over6!r}")
    return out


@dataclass()
class DelayedScaling(Recipe):
    """Per-tensor scales from an amax history (the double accepts it; its linears refuse to run it)."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    if _BACKWARD_OVERRIDE:
        backward_override: Optional[str] = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    def __post_init__(self) -> None:
        _no_pure_e5m2(self)
        _check_backward_override(self)
        if getattr(self, "backward_override", None) is not None:
            raise AssertionError("Delayed scaling only supports backward_override=None.")


@dataclass()
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 scales from the current tensor's amax."""

    use_power_2_scales: bool = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp = QParams(power_2_scale=use_power_2_scales)
    fp8_quant_fwd_weight = QParams(power_2_scale=use_power_2_scales)
    fp8_quant_bwd_grad = QParams(power_2_scale=use_power_2_scales)
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    if _BACKWARD_OVERRIDE:
        backward_override: Optional[str] = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    def __post_init__(self) -> None:
        _no_pure_e5m2(self)
        _check_backward_override(self)


@dataclass()
class MXFP8BlockScaling(Recipe):
    """OCP MXFP8: 32 elements share an E8M0 (power-of-two) scale."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    if _BACKWARD_OVERRIDE:
        backward_override: Optional[str] = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    def __post_init__(self) -> None:
        _no_pure_e5m2(self)
        _check_backward_override(self)


@dataclass()
class Float8BlockScaling(Recipe):
    """FP8 with 1x128 tiles (inputs, gradients) and 128x128 blocks (weights).

    Scales are powers of two by default; NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 at import makes them
    FP32 (the `fp8_quant_*` QParams below are fixed when the class is defined, as in TE).
    """

    use_f32_scales: bool = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp = QParams(power_2_scale=not use_f32_scales)
    fp8_quant_fwd_weight = QParams(power_2_scale=not use_f32_scales)
    fp8_quant_bwd_grad = QParams(power_2_scale=not use_f32_scales)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    if _BACKWARD_OVERRIDE:
        backward_override: Optional[str] = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    def __post_init__(self) -> None:
        dims = (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)
        if any(d not in (1, 2) for d in dims):
            raise AssertionError("Only 1D or 2D blocks supported")
        if sum(d == 2 for d in dims) > 1:
            raise AssertionError("2D by 2D block gemm not supported.")
        if self.fp8_dpa or self.fp8_mha:
            raise AssertionError("FP8 attention is not supported for Float8BlockScaling.")
        _no_pure_e5m2(self)
        _check_backward_override(self)


@dataclass()
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, an E4M3 scale per 16 elements, an FP32 per-tensor scale.

    Defaults: 16x16 weight blocks, stochastic rounding of gradients, a random Hadamard transform
    on the wgrad operands (TE applies it to the column-wise copies only); each can be switched
    off by an NVTE_NVFP4_DISABLE_* variable at import, or by the field.
    """

    disable_rht: bool = os.getenv("NVTE_NVFP4_DISABLE_RHT", "0") == "1"
    disable_stochastic_rounding: bool = os.getenv("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "0") == "1"
    disable_2d_quantization: bool = os.getenv("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "0") == "1"
    if _ROW_SCALED:
        row_scaled_activation: bool = os.getenv("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "0") == "1"
    if _FOUR_OVER_SIX:
        nvfp4_4over6: str = os.getenv("NVTE_NVFP4_4OVER6", "none")
        nvfp4_4over6_e4m3_use_256: str = os.getenv("NVTE_NVFP4_4OVER6_E4M3_USE_256", "all")
        nvfp4_4over6_err_mode: str = os.getenv("NVTE_NVFP4_4OVER6_ERR_MODE", "MAE").upper()
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    if _BACKWARD_OVERRIDE:
        backward_override: Optional[str] = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    def __post_init__(self) -> None:
        if self.fp4_format != Format.E2M1:
            raise AssertionError("Only E2M1 is supported for NVFP4 scaling")
        if self.fp8_format != Format.E4M3:
            raise AssertionError("Only E4M3 is supported for NVFP4 scaling")
        _check_backward_override(self)
        if _FOUR_OVER_SIX:  # v2.18 common/recipe/__init__.py:578-586
            if self.nvfp4_4over6 not in _NVFP4_4OVER6_SCOPES:
                raise AssertionError("NVTE_NVFP4_4OVER6 must be one of: 'none', 'weights', 'activations', 'all'.")
            if self.nvfp4_4over6_e4m3_use_256 not in _NVFP4_4OVER6_SCOPES:
                raise AssertionError("NVTE_NVFP4_4OVER6_E4M3_USE_256 must be one of: 'none', 'weights', "
                                     "'activations', 'all'.")
            if self.nvfp4_4over6_err_mode not in _NVFP4_4OVER6_ERR_MODES:
                raise AssertionError("NVTE_NVFP4_4OVER6_ERR_MODE must be one of: 'MAE', 'MSE'.")
        self.fp4_quant_fwd_inp = QParams(random_hadamard_transform=not self.disable_rht)
        self.fp4_quant_fwd_weight = QParams(fp4_2d_quantization=not self.disable_2d_quantization)
        self.fp4_quant_bwd_grad = QParams(random_hadamard_transform=not self.disable_rht,
                                          stochastic_rounding=not self.disable_stochastic_rounding)


@dataclass()
class CustomRecipe(Recipe):
    """Quantizers from a user factory: a module calls `qfactory(role)` once per tensor role when it
    (re)initialises on this recipe, role one of "linear_input", "linear_weight", "linear_output",
    "linear_grad_output", "linear_grad_input" (TE 2.14's stable contract for te.Linear); None means
    that tensor is not quantized. The double's linears run only TE's reference NVFP4 factory's
    quantizers (pytorch/module/_formats.py)."""

    qfactory: Callable[..., Any]
    fp8_dpa: bool = False
    fp8_mha: bool = False
    if _BACKWARD_OVERRIDE:
        backward_override: Optional[str] = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    def __post_init__(self) -> None:
        _check_backward_override(self)
