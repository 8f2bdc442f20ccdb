"""Refuse Megatron settings that cannot coexist with a precision chosen per layer and re-planned."""

from __future__ import annotations


def check_transformer_config(config) -> None:
    """Raise ValueError if `config` (a TransformerConfig or anything with its fields) asks for
    something that cannot switch precision per layer at a step boundary.

    - delayed scaling: per-module amax histories across steps; Megatron's per-module TE config
      rejects it (`TEQuantizationRecipe.parse_from_config`).
    - FP8/FP4 parameter storage (`fp8_param`, `fp4_param`, i.e. --fp8-param-gather /
      --fp4-param-gather): the weights themselves are stored in one format, so a re-plan cannot
      move a layer to another precision. Keep BF16/FP32 weights.
    """
    if getattr(config, "fp8", None) and getattr(config, "fp8_recipe", None) == "delayed":
        raise ValueError("fp8_recipe='delayed' (delayed scaling) cannot be switched per layer; "
                         "use --fp8-recipe tensorwise, blockwise or mxfp8 with SNIP")
    for field, flag in (("fp8_param", "--fp8-param-gather"), ("fp4_param", "--fp4-param-gather")):
        if getattr(config, field, False):
            raise ValueError(f"{field}=True ({flag}) stores weights in a fixed low-precision "
                             f"format, so SNIP cannot change a layer's precision; turn it off")
