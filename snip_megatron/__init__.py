"""snip-megatron: adaptive per-layer FP8/FP4 precision for Megatron-Core pretraining (SNIP)."""

__version__ = "0.1.0"
