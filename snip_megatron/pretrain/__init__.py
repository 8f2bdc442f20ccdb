"""The Megatron-LM loop with SNIP: `snip-pretrain-gpt` and a patched Megatron-LM `pretrain_gpt.py`.

Both run Megatron-LM's own model builder, layer spec, forward step, data and loop
(`megatron.training.pretrain`); `setup_megatron_lm(args, model_cfg)` (snip_megatron.pretrain.setup)
is the one entrance both use. Needs megatron-core >= 0.19 (which ships `megatron.training`).

    entry.py    main(): Megatron-LM's pretrain_gpt main, with SNIP's flags and setup (the console script)
    setup.py    setup_megatron_lm: checks Megatron's flags, builds the controller, plans the model
    model.py    the layer spec: Megatron's own, SNIP's linears put in, each chunk's quant_recipe
    step.py     MegatronStep: the StepContext the controller sees at a step boundary
    seams.py    where SNIP joins megatron.training (train_step, checkpoint save), signature-checked
    state.py    snip_state.json beside each checkpoint, read for the iteration Megatron loads
    data.py     Megatron-LM's GPT forward step and datasets, plus `--corpus` text tokenized here
    cpu.py      what a run without a GPU needs (gloo, the CPU shim, fused kernels off)
"""
