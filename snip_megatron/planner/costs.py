"""CostTable: the planner's cost Q_l(p) for each planned linear and precision, validated once."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import LayerKey, forward_order, parse_key


class CostTable(Mapping):
    """An immutable mapping LayerKey -> {Precision: float}, in forward order.

    Every cost must be finite (NaN/Inf raise ValueError naming the layer). A layer may omit
    precisions; BF16 defaults to 0 (by definition Q_l(BF16) = 0), any other missing precision simply
    cannot be chosen for that layer.
    """

    def __init__(self, costs: Mapping):
        table: dict[LayerKey, dict[Precision, float]] = {}
        for raw_key, row in costs.items():
            key = parse_key(raw_key)
            if not isinstance(row, Mapping):
                raise ValueError(f"cost of layer {key} must map precision -> cost, got {row!r}")
            clean: dict[Precision, float] = {}
            for p, c in row.items():
                p = Precision.parse(p)
                try:
                    c = float(c)
                except (TypeError, ValueError):
                    raise ValueError(f"cost of layer {key} in {p} is not a number: {c!r}") from None
                if not math.isfinite(c):
                    raise ValueError(f"cost of layer {key} in {p} is {c} (NaN/Inf); fix the statistics "
                                     "of that layer or drop it from the table")
                clean[p] = c
            clean.setdefault(Precision.BF16, 0.0)
            table[key] = clean
        self._table = dict(sorted(table.items(), key=lambda kv: forward_order(kv[0])))

    @classmethod
    def of(cls, costs: "Mapping | CostTable") -> "CostTable":
        return costs if isinstance(costs, CostTable) else cls(costs)

    def __getitem__(self, key) -> dict[Precision, float]:
        return self._table[parse_key(key)]

    def __iter__(self) -> Iterator[LayerKey]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"CostTable({len(self)} linears)"
