"""The inventory of a model's planned linears: what every other part of SNIP plans over (pure).

An adapter (`models.gpt`, ...) builds it, from a model shape without weights or from the built model
chunks of each rank; `merge` joins the ranks' parts into the one global list every rank agrees on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

from snip_megatron.models.keys import LayerKey, parse_key


class ParallelKind(str, Enum):
    """How tensor parallelism shards a linear's weight (out_features x in_features)."""

    COLUMN = "column"
    """Output dim sharded, input replicated (Megatron ColumnParallelLinear)."""
    ROW = "row"
    """Input dim sharded, output a partial sum reduced over TP (RowParallelLinear)."""
    DUPLICATED = "duplicated"
    """Weight replicated over TP (TELinear parallel_mode="duplicated"); gradients all-reduced."""


@dataclass(frozen=True)
class InventoryEntry:
    """One planned linear of the whole model (unsharded)."""

    key: LayerKey
    """Global layer number and the linear's name within its layer."""
    suffix: str
    """Module path below the layer, e.g. "mlp.linear_fc1"."""
    shape: tuple[int, int]
    """(out_features, in_features) of the whole weight, before any TP split."""
    kind: ParallelKind
    """How TP shards it."""
    sp_shards_input: bool = False
    """Whether sequence parallelism hands it a token-sharded input ([s/tp, b, k])."""
    experts: int = 0
    """An MoE layer's routed-expert linear: the number of experts whose same-shaped GEMMs form this
    one unit (`shape` is one expert's); 0 for a plain linear."""
    topk: int = 1
    """Routed copies of each token the unit computes on (the router's top-k; 1 for a plain linear)."""

    @property
    def layer(self) -> int:
        """Global 1-based layer number (Megatron's layer_number)."""
        return self.key.layer

    @property
    def flops_per_token(self) -> int:
        """fprop + dgrad + wgrad: three GEMMs of 2 * out * in FLOPs per token; an expert unit's per
        token of the model, each routed to `topk` experts (Megatron-LM's routed-FLOP count,
        `num_floating_point_operations`: tokens x topk x one expert's GEMMs)."""
        return 6 * self.shape[0] * self.shape[1] * self.topk


@dataclass(frozen=True)
class Unplanned:
    """A module kind that is never planned, and why (reported, never silently skipped)."""

    path: str
    """Module path pattern ("*" for a layer index), e.g. "decoder.layers.*.input_layernorm"."""
    reason: str


class Inventory(Sequence):
    """The planned linears of a model, in forward order, with lookup by key."""

    def __init__(self, family: str, entries: Iterable[InventoryEntry], unplanned: Iterable[Unplanned] = ()):
        self.family = family
        self.entries = tuple(entries)
        self.unplanned = tuple(unplanned)
        self._by_key: dict[LayerKey, InventoryEntry] = {}
        for e in self.entries:
            if e.key in self._by_key:
                raise ValueError(f"{family} inventory lists {e.key} twice ({self._by_key[e.key].suffix!r}, "
                                 f"{e.suffix!r})")
            self._by_key[e.key] = e

    # -- sequence and lookup ---------------------------------------------------------------------

    def __getitem__(self, index):
        return self.entries[index]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[InventoryEntry]:
        return iter(self.entries)

    def __contains__(self, key) -> bool:
        try:
            return parse_key(key) in self._by_key
        except ValueError:
            return False

    def __eq__(self, other) -> bool:
        return isinstance(other, Inventory) and self.entries == other.entries

    def __hash__(self) -> int:
        return hash(self.entries)

    def __repr__(self) -> str:
        return f"Inventory({self.family}: {len(self)} planned linears over {len(self.layers())} layers)"

    def entry(self, key) -> InventoryEntry:
        """The entry of `key`; ValueError naming the model's linears when it has none."""
        k = parse_key(key)
        try:
            return self._by_key[k]
        except KeyError:
            names = sorted({e.key.name for e in self.entries})
            raise ValueError(f"the {self.family} model has no planned linear {k}; its layers have "
                             f"{', '.join(names)} over layers {_span(self.layers())}") from None

    def keys(self) -> tuple[LayerKey, ...]:
        """Every key, in forward order."""
        return tuple(e.key for e in self.entries)

    def layers(self) -> tuple[int, ...]:
        """Global layer numbers that hold planned linears, ascending."""
        return tuple(sorted({e.layer for e in self.entries}))

    @property
    def num_layers(self) -> int:
        """The highest layer number with a planned linear (0 when empty)."""
        return max((e.layer for e in self.entries), default=0)

    def names_by_layer(self) -> dict[int, tuple[str, ...]]:
        """{layer: its linears' names in forward order}."""
        out: dict[int, list[str]] = {}
        for e in self.entries:
            out.setdefault(e.layer, []).append(e.key.name)
        return {layer: tuple(names) for layer, names in out.items()}

    def flop_table(self, tokens: int) -> dict[LayerKey, float]:
        """FLOPs of one training step over `tokens` tokens, per planned linear."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
            raise ValueError(f"tokens={tokens!r} must be a positive integer")
        return {e.key: float(tokens * e.flops_per_token) for e in self.entries}

    # -- agreement ------------------------------------------------------------------------------

    def difference(self, other: "Inventory") -> "str | None":
        """None when both list the same linears in the same order, else what differs first."""
        mine, theirs = {e.key: e for e in self.entries}, {e.key: e for e in other.entries}
        missing = [k for k in mine if k not in theirs]
        extra = [k for k in theirs if k not in mine]
        if missing or extra:
            return (f"{len(missing)} linear(s) missing ({_span(missing)}), {len(extra)} extra "
                    f"({_span(extra)})")
        for k, e in mine.items():
            if theirs[k] != e:
                return f"{k} differs: {e} vs {theirs[k]}"
        if self.keys() != other.keys():
            return "the same linears in another order"
        return None

    def check_same(self, other: "Inventory", *, what: str = "the other inventory") -> "Inventory":
        """Raise ValueError unless `other` lists the same linears; returns self."""
        diff = self.difference(other)
        if diff is not None:
            raise ValueError(f"{self.family} inventory does not match {what}: {diff}")
        return self


def merge(parts: Sequence[Inventory], *, names: "Sequence[str] | None" = None) -> Inventory:
    """One global inventory from per-rank parts (each rank holds some layers; TP/DP peers the same).

    Every layer must come whole from each part that has it, and equal everywhere: a rank that
    sees another shape, kind or set of linears is refused, naming both ranks (`names`, default
    "rank i"). The result is in forward order: by layer, each layer's linears as its parts list them."""
    if not parts:
        raise ValueError("cannot merge an empty list of inventories")
    names = list(names) if names is not None else [f"rank {i}" for i in range(len(parts))]
    families = {p.family for p in parts}
    if len(families) != 1:
        raise ValueError(f"ranks disagree on the model family: {sorted(families)}")
    # a layer is its number within its namespace: the part of its linears' names before the last dot
    # (none for a decoder layer; "mtp" for a GPT's multi-token-prediction layers, numbered from 1 again)
    layers: dict[tuple[str, int], tuple[InventoryEntry, ...]] = {}
    owner: dict[tuple[str, int], str] = {}
    for name, part in zip(names, parts):
        by_layer: dict[tuple[str, int], list[InventoryEntry]] = {}
        for e in part:
            by_layer.setdefault((e.key.name.rpartition(".")[0], e.layer), []).append(e)
        for layer, entries in by_layer.items():
            entries = tuple(entries)
            if layer in layers and layers[layer] != entries:
                raise ValueError(f"ranks disagree on layer {' '.join(map(str, filter(None, layer)))}'s planned linears: {owner[layer]} has "
                                 f"{_describe(layers[layer])}, {name} has {_describe(entries)}; "
                                 "every rank must build the same model (check the layer spec and config)")
            layers.setdefault(layer, entries)
            owner.setdefault(layer, name)
    unplanned = dict.fromkeys(u for p in parts for u in p.unplanned)
    return Inventory(parts[0].family, (e for layer in sorted(layers, key=lambda sl: (sl[0] != "", sl))
                                       for e in layers[layer]), unplanned)


def _describe(entries) -> str:
    return "[" + ", ".join(f"{e.key.name} {e.shape[0]}x{e.shape[1]} {e.kind.value}" for e in entries) + "]"


def _span(items, limit: int = 4) -> str:
    items = list(items)
    shown = ", ".join(str(x) for x in items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
