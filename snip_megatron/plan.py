"""Plan: which precision each planned linear layer runs in, keyed independently of TP/PP/VPP."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

from snip_megatron.formats.precision import Precision

# The four planned linears of a Megatron transformer layer, in forward order.
LINEAR_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class LayerKey(NamedTuple):
    """(global transformer layer number, linear name).

    `layer` is Megatron's 1-based `TransformerLayer.layer_number` (global across pipeline stages),
    so a key names the same weights whatever the TP/PP/VPP split.
    """

    layer: int
    name: str

    def __str__(self) -> str:
        return f"{self.layer}.{self.name}"


def parse_key(key: "LayerKey | tuple | str") -> LayerKey:
    """LayerKey from a LayerKey, a (layer, name) pair or the string "12.linear_fc1"."""
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
    if name not in LINEAR_NAMES:
        raise ValueError(f"bad layer key {key!r}: unknown linear {name!r}; valid: {', '.join(LINEAR_NAMES)}")
    return LayerKey(layer, name)


def forward_order(key: LayerKey) -> tuple[int, int]:
    """Sort key: layer, then the linear's position in the forward pass."""
    return key.layer, LINEAR_NAMES.index(key.name)


def all_keys(num_layers: int) -> list[LayerKey]:
    """Every planned linear of a model with `num_layers` transformer layers, in forward order."""
    return [LayerKey(layer, name) for layer in range(1, num_layers + 1) for name in LINEAR_NAMES]


class Plan(Mapping):
    """An immutable mapping LayerKey -> Precision, kept in forward order."""

    def __init__(self, assignment: "Mapping | Iterable[tuple]" = ()):
        items = assignment.items() if isinstance(assignment, Mapping) else assignment
        table = {parse_key(k): Precision.parse(p) for k, p in items}
        self._table = dict(sorted(table.items(), key=lambda kv: forward_order(kv[0])))

    @classmethod
    def uniform(cls, num_layers: int, precision: "Precision | str") -> "Plan":
        p = Precision.parse(precision)
        return cls({k: p for k in all_keys(num_layers)})

    def __getitem__(self, key) -> Precision:
        return self._table[parse_key(key)]

    def __iter__(self) -> Iterator[LayerKey]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __eq__(self, other) -> bool:
        return isinstance(other, Plan) and self._table == other._table

    def __hash__(self) -> int:
        return hash(tuple(self._table.items()))

    def __repr__(self) -> str:
        counts = {p.value: sum(1 for v in self._table.values() if v is p) for p in Precision}
        return f"Plan({len(self)} linears: {counts})"
