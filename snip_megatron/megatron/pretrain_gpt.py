"""A thin alias of `snip_megatron.pretrain` (the Megatron-LM loop lives there, beside the compact
loop in `snip_megatron.train`), kept so the `snip-pretrain-gpt` console script, launch lines and
patches/megatron-lm-pretrain_gpt.patch keep working:

    python -m snip_megatron.megatron.pretrain_gpt ...  ==  python -m snip_megatron.pretrain ...
"""

from snip_megatron.pretrain.entry import cli, main  # noqa: F401
from snip_megatron.pretrain.setup import setup_megatron_lm  # noqa: F401

if __name__ == "__main__":
    cli()
