"""Test double of `transformer_engine.pytorch.custom_recipes` (TE 2.14): the reference NVFP4
quantizer factory TE's own tests give a `CustomRecipe` (`quantization_nvfp4`)."""
