"""Megatron-Core glue: CPU runtime, model builder, layer specs, quant_recipe matchers, CLI args."""
