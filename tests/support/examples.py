"""Settings for the rules' unit tests: a tiny dense GPT's real Megatron-Core configs with a rule's
example values set on them (attributes set as a config holds them, without the configs' own
validation: the entry tests feed the same values through each entry's real input)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace


def base_configs(**model_fields):
    """(TransformerConfig, DDP config, OptimizerConfig) of a 2-layer, 64-wide GPT on the local spec."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = TransformerConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                              num_query_groups=2, transformer_impl="local", **model_fields)
    return model, DistributedDataParallelConfig(), OptimizerConfig()


def settings(example: dict, entry: str, **snip_fields):
    """The Settings of `entry` with `example` (path -> value) set on the base configs."""
    from snip_megatron.config import SnipConfig
    from snip_megatron.support.settings import RunFacts, Settings

    model, ddp, optimizer = base_configs()
    sections = dict(model=model, ddp=ddp, optimizer=optimizer, checkpoint=SimpleNamespace(),
                    dist=SimpleNamespace())
    facts, snip = {}, dict(enabled=True, **snip_fields)
    for path, value in example.items():
        section, _, name = path.partition(".")
        if section == "run":
            facts[name] = value
        elif section == "snip":
            snip[name] = list(value) if isinstance(value, tuple) else value
        else:
            setattr(sections[section], name, value)
    facts.setdefault("backend", "te" if model.transformer_impl == "transformer_engine" else "emulated")
    run = dataclasses.replace(RunFacts(entry=entry), **facts)
    return Settings(snip=SnipConfig(**snip), run=run, **sections)
