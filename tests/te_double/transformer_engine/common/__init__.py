"""Test double of `transformer_engine.common` (TE 2.14): only the recipes (no C library to load)."""

from transformer_engine.common import recipe  # noqa: F401
