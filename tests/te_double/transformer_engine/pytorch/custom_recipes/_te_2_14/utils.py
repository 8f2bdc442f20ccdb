"""Test double of `transformer_engine.pytorch.custom_recipes.utils` (TE 2.10-2.18): the FP4 format enum."""

from transformer_engine.pytorch._reference_nvfp4 import Fp4Formats  # noqa: F401
