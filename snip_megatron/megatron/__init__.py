"""Megatron-Core glue: CPU runtime, model builder, layer specs, quant_recipe matchers, CLI args."""

from snip_megatron.megatron.args import add_snip_args, snip_config_from_args  # noqa: F401  (argparse only)
