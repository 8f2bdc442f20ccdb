"""Test double of `transformer_engine.pytorch.custom_recipes.quantization_ref_nvfp4` (TE 2.16-2.18).

TE 2.16 renamed `quantization_nvfp4` to this module; its factory now takes a `QuantizerRole`
(`_reference_nvfp4.nvfp4_ref_rht_2d_quantizer_factory_by_role`), a protocol the double's modules
do not model (they refuse a CustomRecipe on TE >= 2.16).
"""

from transformer_engine.pytorch._reference_nvfp4 import NVFP4QuantizerRef  # noqa: F401
from transformer_engine.pytorch._reference_nvfp4 import (  # noqa: F401
    nvfp4_ref_rht_2d_quantizer_factory_by_role as nvfp4_ref_rht_2d_quantizer_factory)
