"""snip-analyze: one SNIP measurement on a saved checkpoint, and the plans it recommends at a list
of budgets, without training and without writing into the checkpoint.

    snip-analyze --load CKPT --budgets 0.5,0.75,0.9 --out DIR <the run's own flags>

The checkpoint is Megatron-LM's (`snip-pretrain-gpt`, or a patched `pretrain_gpt.py`: the run's
Megatron-LM flags) or the compact loop's (`snip-train` / `python -m snip_megatron.train`: its
flags), told apart by the compact loop's manifest. Parts, one job each: `cli` (flags, refusals,
the run), `megatron_lm` and `compact` (load and measure in each loop), `plans` (solve the budgets,
evaluate the recipe rules), `output` (table, files, picture).
"""
