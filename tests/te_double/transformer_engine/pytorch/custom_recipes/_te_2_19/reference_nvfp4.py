"""Test double of `transformer_engine.pytorch.custom_recipes.reference_nvfp4` (TE after 2.18).

TE's main (2.20.0.dev0) renamed `quantization_ref_nvfp4` to this module and its factory to
`nvfp4_ref_rht_2d_factory(role: QuantizerRole)`; the double's modules do not model that protocol
(they refuse a CustomRecipe on TE >= 2.16).
"""

from transformer_engine.pytorch._reference_nvfp4 import NVFP4QuantizerRef  # noqa: F401
from transformer_engine.pytorch._reference_nvfp4 import (  # noqa: F401
    nvfp4_ref_rht_2d_quantizer_factory_by_role as nvfp4_ref_rht_2d_factory)
