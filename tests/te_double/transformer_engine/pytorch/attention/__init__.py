"""Test double of `transformer_engine.pytorch.attention` (TE 2.14): DotProductAttention only.

TE's `_SplitAlongDim` and fused RoPE (`attention.rope`) are absent on purpose: Megatron imports
them under try/except ImportError and falls back to torch.split and its own RoPE."""

from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention

__all__ = ["DotProductAttention"]
