"""LayerKey: the global name of one planned linear, independent of TP/PP/VPP (pure)."""

from __future__ import annotations

import re
from typing import NamedTuple

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


class LayerKey(NamedTuple):
    """(global layer number, linear name within that layer).

    `layer` is Megatron's 1-based `layer_number` (global across pipeline stages), so a key names the
    same weights whatever the TP/PP/VPP split. `name` is what the model family's adapter calls the
    linear inside its layer (e.g. a GPT layer's "linear_fc1"); it may contain dots.
    """

    layer: int
    name: str

    def __str__(self) -> str:
        return f"{self.layer}.{self.name}"


def parse_key(key: "LayerKey | tuple | str") -> LayerKey:
    """LayerKey from a LayerKey, a (layer, name) pair or the string "12.linear_fc1".

    Only the form is checked here; whether a model has that linear is its inventory's question."""
    if isinstance(key, LayerKey) and type(key.layer) is int and key.layer >= 1:
        return key  # the hot path: already parsed
    if isinstance(key, str):
        layer, sep, name = key.partition(".")
        if not sep:
            raise ValueError(f"bad layer key {key!r}; expected '<layer>.<linear name>'")
        key = (layer, name)
    try:
        layer, name = key
        layer = int(layer)
    except (TypeError, ValueError):
        raise ValueError(f"bad layer key {key!r}; expected (layer number, linear name)") from None
    if layer < 1:
        raise ValueError(f"bad layer key {key!r}: layer numbers start at 1 (Megatron's layer_number)")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"bad layer key {key!r}: the linear name {name!r} must be dotted identifiers "
                         "such as 'linear_fc1'")
    return LayerKey(layer, name)
