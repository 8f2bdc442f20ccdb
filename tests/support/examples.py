"""Settings for the rules' unit tests: a tiny dense GPT's real Megatron-Core configs with a rule's
example values set on them (snip_megatron.support.example, at the tests' sizes)."""

from __future__ import annotations

from snip_megatron.support import example

TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2)


def settings(values: dict, entry: str):
    """The Settings of `entry` with `values` (path -> value) set on the tiny GPT's configs."""
    return example.settings(values, entry, **TINY)
