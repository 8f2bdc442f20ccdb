"""`python -m snip_megatron.pretrain ...` = `snip-pretrain-gpt ...`."""

from snip_megatron.pretrain.entry import cli

if __name__ == "__main__":
    cli()
