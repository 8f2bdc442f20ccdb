"""SNIP in Megatron-Bridge (NeMo's LLM pretraining): `pretrain(cfg, forward_step, callbacks=enable_snip(cfg, snip))`.

    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from snip_megatron.bridge import enable_snip
    from snip_megatron.config import SnipConfig

    pretrain(cfg, forward_step, callbacks=enable_snip(cfg, SnipConfig(enabled=True, fp4_budget=0.75)))

or `snip-bridge-pretrain --recipe <module:function> snip.fp4_budget=0.75 train.train_iters=...`.
Bridge builds, trains and checkpoints the model; SNIP adds its linears and each chunk's
quant_recipe (through the layer spec), the controller at step boundaries, and its state beside
Bridge's checkpoints. One SNIP run per process at a time. Needs megatron-bridge (0.6.2 tested).

    enable.py       enable_snip: the support check, the run, layer spec, checkpoint manager, train_step seam
    settings.py     the ConfigContainer as snip_megatron.support's rules read it (what SNIP refuses)
    run.py          BridgeRun: one SNIP run in Bridge (controller, step boundary, resume, saves)
    model.py        SnipLayerSpec: Bridge's layer spec with SNIP's linears and the chunk's quant_recipe
    seams.py        the one wrapped Bridge function (train_step), signature-checked
    checkpoint.py   SnipCheckpointManager: SNIP's state saved with, and loaded for, Bridge's checkpoints
    callbacks.py    SnipCallback: Bridge's callback events the run listens to
    cli.py          snip-bridge-pretrain (Bridge's recipe + override syntax, snip.* validated by SnipConfig)
"""

from snip_megatron.bridge.enable import enable_snip

__all__ = ["enable_snip"]
