"""Test double of `transformer_engine.pytorch.custom_recipes.quantization_nvfp4` (TE 2.10-2.15).

TE's Python reference of NVFP4 and its `CustomRecipe` qfactory; see
`transformer_engine/pytorch/_reference_nvfp4.py` for what the double keeps of it.
"""

from transformer_engine.pytorch._reference_nvfp4 import (NVFP4QuantizerRef,  # noqa: F401
                                                          nvfp4_ref_rht_2d_quantizer_factory)
