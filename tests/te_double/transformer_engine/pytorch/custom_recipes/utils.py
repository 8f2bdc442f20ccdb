"""Test double of `transformer_engine.pytorch.custom_recipes.utils` (TE 2.14): the FP4 format enum."""

import enum


class Fp4Formats(enum.Enum):
    """FP4 data format."""

    E2M1 = "e2m1"
