"""Test doubles of the TE 2.14 modules Megatron's GPT layer spec builds."""

from transformer_engine.pytorch.module.base import QuantizedRun, TransformerEngineBaseModule
from transformer_engine.pytorch.module.grouped_linear import GroupedLinear
from transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear
from transformer_engine.pytorch.module.linear import Linear
from transformer_engine.pytorch.module.norms import LayerNorm, RMSNorm

__all__ = ["GroupedLinear", "LayerNorm", "LayerNormLinear", "Linear", "QuantizedRun", "RMSNorm",
           "TransformerEngineBaseModule"]
