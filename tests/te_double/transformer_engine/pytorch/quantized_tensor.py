"""Test double of `transformer_engine.pytorch.quantized_tensor` (TE 2.14): re-exports the types."""

from transformer_engine.pytorch.tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer  # noqa: F401
