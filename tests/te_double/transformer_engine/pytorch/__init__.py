"""Test double of `transformer_engine.pytorch` (TE 2.14): the names Megatron-Core's TE wrappers use.

See the package docstring (`transformer_engine/__init__.py`) for what is modelled and what is not.
"""

from transformer_engine.pytorch import ops  # noqa: F401
from transformer_engine.pytorch.attention import DotProductAttention
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker, checkpoint
from transformer_engine.pytorch.module import (GroupedLinear, LayerNorm, LayerNormLinear, Linear,
                                               QuantizedRun, RMSNorm)
from transformer_engine.pytorch.quantization import (autocast, fp8_autocast, fp8_model_init,
                                                     get_default_recipe, is_fp8_available,
                                                     is_fp8_block_scaling_available,
                                                     is_mxfp8_available, is_nvfp4_available,
                                                     quantized_model_init)
from transformer_engine.pytorch.tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer

__all__ = [
    "CudaRNGStatesTracker", "DotProductAttention", "GroupedLinear", "LayerNorm", "LayerNormLinear",
    "Linear", "QuantizedRun", "QuantizedTensor", "QuantizedTensorStorage", "Quantizer", "RMSNorm",
    "autocast", "checkpoint", "fp8_autocast", "fp8_model_init", "get_default_recipe",
    "is_fp8_available", "is_fp8_block_scaling_available", "is_mxfp8_available",
    "is_nvfp4_available", "quantized_model_init",
]
