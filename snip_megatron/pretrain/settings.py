"""Megatron-LM's parsed arguments as the Settings SNIP's support rules read (snip_megatron.support).

Megatron-LM's own converters build the configs (`core_transformer_config_from_args`,
`get_megatron_ddp_config`, `get_megatron_optimizer_config`), so a rule reads what Megatron will
build; checkpointing and distributed set-up are read into Megatron-LM's CheckpointConfig and
DistributedInitConfig the way `pretrain_cfg_container_from_args` fills them.
"""

from __future__ import annotations

import dataclasses
import warnings

from snip_megatron.support.settings import RunFacts, Settings


def _config_from_args(cls, args):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def run_facts(args, family: str, backend: str, entry: str = "megatron-lm") -> RunFacts:
    import torch

    from snip_megatron.te.installed import te_facts

    return RunFacts(entry=entry, family=family, backend=backend, world_size=int(getattr(args, "world_size", 1)),
                    hybrid_pattern=getattr(args, "hybrid_layer_pattern", None),
                    dataloader_type=getattr(args, "dataloader_type", None),
                    freeze_all_layers=bool(getattr(args, "freeze_all_layers", False)),
                    cuda=torch.cuda.is_available(), **te_facts(backend))


def settings_of(args, snip, backend: str, family: str = "gpt", transformer_config=None,
                entry: str = "megatron-lm") -> Settings:
    """The Settings of a Megatron-LM run: its TransformerConfig (`transformer_config`, the one the
    run's model config holds, else built from `args` as Megatron-LM builds it), DDP, optimizer,
    checkpoint and distributed configs, and its facts."""
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.config import CheckpointConfig, DistributedInitConfig
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformer_config if transformer_config is not None else core_transformer_config_from_args(args)
        ddp = get_megatron_ddp_config(args)
        optimizer, _ = get_megatron_optimizer_config(args)
    return Settings(model=model, snip=snip, run=run_facts(args, family, backend, entry), ddp=ddp, optimizer=optimizer,
                    checkpoint=_config_from_args(CheckpointConfig, args),
                    dist=_config_from_args(DistributedInitConfig, args))
