"""Number formats (BF16, FP8, FP4) and their exact fake quantizers; pure torch, any device."""

from snip_megatron.formats.error import quantization_error
from snip_megatron.formats.hadamard import hadamard_last_dim, hadamard_matrix
from snip_megatron.formats.precision import FP4_RECIPES, FP8_RECIPES, Formats, Precision
from snip_megatron.formats.quantize import (
    QuantizedTensor, quantize, quantize_for_role, quantize_reference,
)
from snip_megatron.formats.spec import (
    GEMM_OPERANDS, CastConfig, ElementFormat, FormatSpec, Role, Rounding,
    ScaleFormat,
)

__all__ = [
    "FP4_RECIPES", "FP8_RECIPES", "GEMM_OPERANDS", "CastConfig", "ElementFormat", "Formats", "FormatSpec",
    "Precision", "QuantizedTensor", "Role", "Rounding", "ScaleFormat", "hadamard_last_dim",
    "hadamard_matrix", "quantization_error", "quantize", "quantize_for_role", "quantize_reference",
]
