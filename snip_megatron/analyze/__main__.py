"""`python -m snip_megatron.analyze ...` = `snip-analyze ...`."""

from snip_megatron.analyze.cli import cli

if __name__ == "__main__":
    cli()
