"""Transformer Engine backend: a plan's precisions as per-module TE quantization configs.

The translation is pure Python (tested on CPU); only the TE linears that read it need a GPU.
"""

from snip_megatron.te.checks import check_transformer_config
from snip_megatron.te.options import TE_FP4_RECIPES, TEOptions, default_fp8_recipe, has_native_fp4
from snip_megatron.te.translate import (ModuleConfig, emulated_params, module_config,
                                        precision_of_te_params, te_config_dict, te_params,
                                        te_recipe)

__all__ = [
    "TE_FP4_RECIPES", "ModuleConfig", "TEOptions", "check_transformer_config",
    "default_fp8_recipe", "emulated_params", "has_native_fp4", "module_config",
    "precision_of_te_params", "te_config_dict", "te_params", "te_recipe",
]
