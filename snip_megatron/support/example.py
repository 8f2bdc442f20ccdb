"""Settings of a representative run, for the support matrix and the rules' examples: Megatron-Core's
real configs of a Llama-like GPT with the given values set on them (as the configs hold them, without
their own validation: the entries' tests feed the same values through each entry's real input)."""

from __future__ import annotations

import copy
import dataclasses
import functools
from types import SimpleNamespace

BASE = dict(num_layers=4, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=8, num_query_groups=8,
            transformer_impl="local")
"""A Llama-like GPT of realistic widths (TE's FP8/FP4 kernels take multiples of 128)."""


def settings(example: dict, entry: str, **model_fields):
    """The Settings of `entry` with `example` (path -> value) set on the base configs."""
    from snip_megatron.config import SnipConfig
    from snip_megatron.support.settings import RunFacts, Settings

    model, ddp, optimizer = (copy.copy(c) for c in _configs(tuple(sorted(model_fields.items()))))
    sections = dict(model=model, ddp=ddp, optimizer=optimizer, checkpoint=SimpleNamespace(), dist=SimpleNamespace())
    facts, snip = {}, {"enabled": True}
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


@functools.lru_cache(maxsize=8)
def _configs(model_fields: tuple):
    """The base configs, built once (Megatron's __post_init__ checks are slow); callers copy them."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{**BASE, **dict(model_fields)}), DistributedDataParallelConfig(), OptimizerConfig()
