"""Test double of `transformer_engine.pytorch.tensor` (TE 2.14): the quantized tensor types exist so
Megatron's isinstance checks run, but the double never makes one (weights stay high precision)."""

import torch


class Quantizer:
    """TE's quantizer base class (never instantiated by the double)."""


class QuantizedTensorStorage:
    """TE's storage mixin for quantized data (never instantiated by the double)."""


class QuantizedTensor(torch.Tensor):
    """TE's quantized tensor base class (never instantiated by the double)."""


__all__ = ["QuantizedTensor", "QuantizedTensorStorage", "Quantizer"]
