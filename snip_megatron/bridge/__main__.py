"""`python -m snip_megatron.bridge ...` = `snip-bridge-pretrain ...`."""

from snip_megatron.bridge.cli import cli

if __name__ == "__main__":
    cli()
