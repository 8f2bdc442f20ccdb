"""Test double of `transformer_engine.pytorch.custom_recipes.quantization_nvfp4` (TE 2.14).

TE's module is a Python reference of NVFP4: `NVFP4QuantizerRef` quantizes a tensor row-wise (the
fprop / dgrad copy) and column-wise (the transposed copy the wgrad GEMM reads), with E4M3 scales
per 1x16 (or 16x16) tile on an FP32 per-tensor scale, rounding to nearest (no stochastic rounding);
`with_rht=True` applies the 16-point random Hadamard transform to the column-wise copy only; its
GEMM dequantizes and multiplies in high precision. `nvfp4_ref_rht_2d_quantizer_factory(role)` is the
qfactory of a `CustomRecipe`: RHT quantizers for "linear_input" and "linear_grad_output", a 16x16
quantizer for "linear_weight", None (not quantized) for "linear_output" and "linear_grad_input".

The double keeps the factory and the quantizers' constructor settings, not their arithmetic: a
double module that runs a CustomRecipe asks the factory for its quantizers (TE's qfactory call
protocol) and maps exactly this set to our emulation, `Formats(fp4_recipe="nvfp4",
fp4_gradient_rounding="nearest")` (see `pytorch/module/_formats.py`); any other set is refused.
"""

from __future__ import annotations

from typing import Optional, Tuple

from transformer_engine.pytorch.custom_recipes import utils
from transformer_engine.pytorch.quantized_tensor import Quantizer


class NVFP4QuantizerRef(Quantizer):
    """TE 2.14's reference NVFP4 quantizer: its settings (the double never calls it on data)."""

    def __init__(self, dtype: utils.Fp4Formats, rowwise: bool = True, columnwise: bool = True,
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


def nvfp4_ref_rht_2d_quantizer_factory(role: str) -> Optional[NVFP4QuantizerRef]:
    """TE's qfactory: the reference NVFP4 quantizer of a te.Linear tensor role (RHT on the input and
    gradient, whose column-wise copies feed wgrad; 16x16 weight tiles), None for the outputs."""
    if role in ("linear_input", "linear_grad_output"):
        return NVFP4QuantizerRef(dtype=utils.Fp4Formats.E2M1, quant_tile_shape=(1, 16),
                                 pow_2_scales=False, with_rht=True)
    if role == "linear_weight":
        return NVFP4QuantizerRef(dtype=utils.Fp4Formats.E2M1, quant_tile_shape=(16, 16),
                                 pow_2_scales=False, with_rht=False)
    return None
