"""The compact loop's TrainConfig as the Settings SNIP's support rules read (snip_megatron.support):
the TransformerConfig it builds (megatron.model.make_transformer_config, with the spec its backend
builds) and its DDP config; the compact loop's limits are the rules' (entry "compact")."""

from __future__ import annotations


def settings_of(cfg, world_size: int, snip=None):
    """The Settings of compact-loop run `cfg` on `world_size` processes (`snip`: its SnipConfig;
    the compact loop's own limits hold with SNIP or without)."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig

    from snip_megatron.config import SnipConfig
    from snip_megatron.megatron.model import make_transformer_config
    from snip_megatron.support.settings import RunFacts, Settings
    from snip_megatron.te.installed import te_installed

    experts = cfg.moe.config_fields() if cfg.moe is not None else {}
    impl = "transformer_engine" if cfg.backend == "te" else "local"
    model = make_transformer_config(cfg.shape, tp=cfg.tp, pp=cfg.pp, mla=cfg.mla, transformer_impl=impl, **experts)
    facts = RunFacts(entry="compact", backend="te" if cfg.backend == "te" else "emulated", world_size=world_size,
                     te_installed=te_installed(), cuda=torch.cuda.is_available())
    return Settings(model=model, snip=snip if snip is not None else SnipConfig(), run=facts,
                    ddp=DistributedDataParallelConfig(use_distributed_optimizer=cfg.distributed_optimizer))


def check(cfg, world_size: int, snip=None) -> None:
    """ValueError naming every setting of `cfg` the compact loop cannot run, with the fix."""
    from snip_megatron.support.check import refusal_message, refusals
    from snip_megatron.support.names import CompactNames

    lines = refusals(settings_of(cfg, world_size, snip), CompactNames())
    if lines:
        raise ValueError(refusal_message(f"the compact loop cannot run this (--model {cfg.shape.name}, --tp {cfg.tp}, "
                                         f"--pp {cfg.pp}, {world_size} process{'es' if world_size != 1 else ''})", lines))
