"""snip-analyze: one SNIP measurement on a saved checkpoint, and the plans it recommends at a list
of budgets, without training and without writing into the checkpoint.

    snip-analyze --load CKPT --budgets 0.5,0.75,0.9 --out DIR <the run's own flags>

The checkpoint is Megatron-LM's (`snip-pretrain-gpt` / `snip-pretrain-hybrid`, or a patched
`pretrain_gpt.py` / `pretrain_hybrid.py`: the run's Megatron-LM flags, --hybrid-layer-pattern for a
HybridModel), Megatron-Bridge's (`--recipe`) or the compact loop's (`snip-train` / `python -m
snip_megatron.train`: its flags), told apart by the compact loop's manifest and Bridge's run config;
every model SNIP trains (dense, MLA, MTP, MoE, HybridModel) is planned by its inventory. Parts, one
job each: `cli` (flags, refusals, the run), `checkpoint` (which loop saved it), `megatron_lm`,
`bridge` and `compact` (load and measure in each loop), `quiet` (the loop's own output held back),
`plans` (solve the budgets, evaluate the recipe rules), `output` (table, files, picture).
"""
