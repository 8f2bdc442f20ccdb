"""`python -m snip_megatron.pretrain.hybrid ...` = `snip-pretrain-hybrid ...`: Megatron-LM's
pretrain_hybrid.py main (a HybridModel of --hybrid-layer-pattern) with SNIP."""

from snip_megatron.pretrain.entry import cli_hybrid

if __name__ == "__main__":
    cli_hybrid()
