"""Test double of `transformer_engine.pytorch.fp8` (TE 2.14): the deprecated module Megatron
0.16/0.19 import the autocast from; it re-exports `transformer_engine.pytorch.quantization`."""

import warnings

warnings.warn("Using deprecated internal API from Transformer Engine. transformer_engine.pytorch.fp8 "
              "will be removed in a future release.", DeprecationWarning, stacklevel=2)

from transformer_engine.common.recipe import (  # noqa: E402,F401
    CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
    MXFP8BlockScaling, NVFP4BlockScaling, Recipe,
)
from transformer_engine.pytorch.quantization import (  # noqa: E402,F401
    FP8GlobalStateManager, check_recipe_support, fp8_autocast, fp8_model_init,
    get_default_fp8_recipe, get_fp8_torch_dtype,
)
