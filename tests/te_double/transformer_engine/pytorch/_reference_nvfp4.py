"""The reference NVFP4 quantizer of TE's `custom_recipes` (one implementation for every layout).

TE's module is a Python reference of NVFP4 (TE 2.14 `pytorch/custom_recipes/quantization_nvfp4.py`;
renamed `quantization_ref_nvfp4` in 2.16 and `reference_nvfp4` after 2.18, see
`custom_recipes/__init__.py`): `NVFP4QuantizerRef` quantizes a tensor row-wise (the fprop / dgrad
copy) and column-wise (the transposed copy the wgrad GEMM reads), with E4M3 scales per 1x16 (or
16x16) tile on an FP32 per-tensor scale, rounding to nearest (no stochastic rounding);
`with_rht=True` applies the 16-point random Hadamard transform to the column-wise copy only; its
GEMM (`qgemm`) dequantizes and multiplies in FP32.

The double keeps the factories and the quantizers' constructor settings (TE 2.14's), and computes
with its own NVFP4 quantizer, which follows the same kernel arithmetic (the reference's
`_quantize_blockwise_reference`, quantization_nvfp4.py:442-532, says it matches "the kernel's
default path"): a double module that runs a CustomRecipe asks the factory for its quantizers (TE
2.14's qfactory call protocol) and maps exactly TE 2.14's set to NVFP4 with nearest rounding, RHT
on the input's and grad output's column-wise copies and 16x16 weight tiles (`module/_formats.py`,
`module/_quantize.py`). What
the reference path adds at run time (its tensor emptied when saved for backward, its GEMM's bias
and shape refusals) is modelled in `module/base.py`.
"""

from __future__ import annotations

import enum
from typing import Optional, Tuple

from transformer_engine.pytorch.quantized_tensor import Quantizer


class Fp4Formats(enum.Enum):
    """FP4 data format (TE's `custom_recipes.utils.Fp4Formats`)."""

    E2M1 = "e2m1"


class NVFP4QuantizerRef(Quantizer):
    """TE 2.14's reference NVFP4 quantizer: its settings (the double never calls it on data)."""

    def __init__(self, dtype: Fp4Formats, rowwise: bool = True, columnwise: bool = True,
                 pow_2_scales: bool = False, eps: float = 0.0,
                 quant_tile_shape: Tuple[int, int] = (1, 16), with_rht: bool = False,
                 with_random_sign_mask: bool = True) -> None:
        self.rowwise_usage, self.columnwise_usage = rowwise, columnwise
        self.internal = True
        self.dtype = dtype
        self.pow_2_scales = pow_2_scales
        self.eps = eps
        self.quant_tile_shape = tuple(quant_tile_shape)
        self.with_rht = with_rht
        self.with_random_sign_mask = with_random_sign_mask

    @property
    def custom(self) -> bool:
        return True

    def settings(self) -> tuple:
        """What decides its numerics (the double compares these)."""
        return (self.dtype, self.pow_2_scales, self.eps, self.quant_tile_shape, self.with_rht,
                self.with_random_sign_mask)


def _rht_1x16() -> NVFP4QuantizerRef:
    return NVFP4QuantizerRef(dtype=Fp4Formats.E2M1, quant_tile_shape=(1, 16), pow_2_scales=False,
                             with_rht=True)


def _tiles_16x16() -> NVFP4QuantizerRef:
    return NVFP4QuantizerRef(dtype=Fp4Formats.E2M1, quant_tile_shape=(16, 16), pow_2_scales=False,
                             with_rht=False)


def nvfp4_ref_rht_2d_quantizer_factory(role: str) -> Optional[NVFP4QuantizerRef]:
    """TE 2.14's qfactory (quantization_nvfp4.py:17-47): RHT 1x16 quantizers for "linear_input" and
    "linear_grad_output" (their column-wise copies feed wgrad), 16x16 tiles for "linear_weight",
    None (not quantized) for the outputs."""
    if role in ("linear_input", "linear_grad_output"):
        return _rht_1x16()
    if role == "linear_weight":
        return _tiles_16x16()
    return None


def nvfp4_ref_rht_2d_quantizer_factory_by_role(role) -> NVFP4QuantizerRef:
    """TE 2.16-2.18's factory (quantization_ref_nvfp4.py:17-45 @v2.16; `reference_nvfp4.
    nvfp4_ref_rht_2d_factory` after 2.18): it takes a `QuantizerRole` (module_type, tensor_type,
    name), gives 16x16 tiles to the weight of a linear / grouped_linear and an RHT 1x16 quantizer to
    every other slot, outputs included. The double's modules do not call it (TE >= 2.16's
    QuantizerRole protocol is not modelled: they refuse a CustomRecipe there)."""
    weight = (role is not None and role.module_type in ("linear", "grouped_linear")
              and role.tensor_type == "weight")
    return _tiles_16x16() if weight else _rht_1x16()
