"""Transformer Engine backend: a plan's precisions as per-module TE quantization configs (GPU only)."""
