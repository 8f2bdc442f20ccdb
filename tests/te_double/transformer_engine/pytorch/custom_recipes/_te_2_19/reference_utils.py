"""Test double of `transformer_engine.pytorch.custom_recipes.reference_utils` (TE after 2.18): the FP4 format enum."""

from transformer_engine.pytorch._reference_nvfp4 import Fp4Formats  # noqa: F401
