"""Plan: which precision each planned linear layer runs in, keyed independently of TP/PP/VPP.

Keys are the model's inventory keys (`models.inventory`): (global layer number, linear name). A
plan is checked against a model as an `Inventory`, or, as before the inventory existed, as the
number of layers of a dense GPT (an int).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple, Union

from snip_megatron.formats.precision import Precision
from snip_megatron.models import gpt
from snip_megatron.models.inventory import Inventory
from snip_megatron.models.keys import LayerKey, parse_key
from snip_megatron.models.order import forward_order

# Bumped when the serialised layout changes; readers refuse versions they do not know.
# v1: the dense GPT's four linears per layer only. v2: any inventory's linear names.
PLAN_FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)

LINEAR_NAMES = gpt.LINEAR_NAMES
"""The dense GPT layer's linears (the only names a v1 plan holds)."""

Model = Union[int, Inventory]
"""What a plan is checked against: a model's inventory, or the layer count of a dense GPT."""

__all__ = ["LINEAR_NAMES", "LayerKey", "Model", "PLAN_FORMAT_VERSION", "Plan", "PlanChange", "all_keys",
           "forward_order", "model_keys", "parse_key"]


def all_keys(num_layers: int) -> list[LayerKey]:
    """Every planned linear of a dense GPT with `num_layers` layers, in forward order."""
    return gpt.keys(num_layers)


def model_keys(model: Model) -> list[LayerKey]:
    """The keys of `model` (an Inventory, or a dense GPT's layer count) in forward order."""
    if isinstance(model, Inventory):
        return list(model.keys())
    if not isinstance(model, int) or isinstance(model, bool) or model < 1:
        raise ValueError(f"a model is an Inventory or a positive number of layers, got {model!r}")
    return all_keys(model)


def _describe(model: Model) -> str:
    if isinstance(model, Inventory):
        return f"{model.family}: {len(model)} linears over {len(model.layers())} layers"
    return f"{model} layers x {', '.join(LINEAR_NAMES)}"


class PlanChange(NamedTuple):
    """One linear whose precision differs between two plans (None: the key is absent there)."""

    key: LayerKey
    old: "Precision | None"
    new: "Precision | None"

    def __str__(self) -> str:
        return f"{self.key}: {self.old} -> {self.new}"


class Plan(Mapping):
    """An immutable mapping LayerKey -> Precision, kept in forward order.

    Serialised form (JSON or YAML), each layer's inventory keys in forward order::

        {"version": 2, "num_layers": 2,
         "layers": {"1": {"linear_qkv": "fp8", "linear_proj": "fp4", ...}, "2": {...}}}

    Version 1 (before the inventory) is the same layout with a dense GPT's four names only; it
    still loads, and a plan of only those names is still written as version 1 (same digest).
    """

    def __init__(self, assignment: "Mapping | Iterable[tuple]" = (), *, inventory: "Inventory | None" = None):
        """`inventory`: refuse keys that model does not have (ValueError naming them)."""
        items = assignment.items() if isinstance(assignment, Mapping) else assignment
        table = {parse_key(k): Precision.parse(p) for k, p in items}
        if inventory is not None:
            for k in table:
                inventory.entry(k)
        self._table = dict(sorted(table.items(), key=lambda kv: forward_order(kv[0])))

    @classmethod
    def uniform(cls, model: Model, precision: "Precision | str") -> "Plan":
        """Every linear of `model` (an Inventory, or a dense GPT's layer count) in `precision`."""
        p = Precision.parse(precision)
        return cls({k: p for k in model_keys(model)})

    # -- Mapping -----------------------------------------------------------------------------

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
        return f"Plan({len(self)} linears: {self.counts()}, digest {self.digest()[:12]})"

    # -- views ---------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """The highest layer number planned (0 for an empty plan)."""
        return max((k.layer for k in self._table), default=0)

    def counts(self) -> dict[str, int]:
        """Number of linears per precision, e.g. {"bf16": 0, "fp8": 10, "fp4": 14}."""
        return {p.value: sum(1 for v in self._table.values() if v is p) for p in Precision}

    def replace(self, updates: "Mapping | Iterable[tuple]") -> "Plan":
        """A new plan with `updates` ({key: precision}) applied on top of this one."""
        items = updates.items() if isinstance(updates, Mapping) else updates
        return Plan({**self._table, **{parse_key(k): Precision.parse(p) for k, p in items}})

    # -- checks against a model ----------------------------------------------------------------

    def check_model(self, model: Model) -> "Plan":
        """Raise ValueError unless this plan covers exactly the planned linears of `model` (an
        Inventory, or the layer count of a dense GPT). Returns self for chaining."""
        if not isinstance(model, Inventory) and (not isinstance(model, int) or isinstance(model, bool)
                                                 or model < 1):
            raise ValueError(f"num_layers must be a positive integer, got {model!r}")
        expected = set(model_keys(model))
        extra = sorted(set(self._table) - expected, key=forward_order)
        if extra:
            raise ValueError(f"plan has {len(extra)} key(s) the model lacks (model: {_describe(model)}): "
                             f"{_preview(extra)}")
        missing = sorted(expected - set(self._table), key=forward_order)
        if missing:
            layers = sorted({k.layer for k in missing})
            raise ValueError(f"plan is missing {len(missing)} linear(s) of the model, in layer(s) "
                             f"{_preview(layers)}: {_preview(missing)}")
        return self

    # -- comparison ----------------------------------------------------------------------------

    def diff(self, other: "Plan") -> list[PlanChange]:
        """The linears whose precision differs from `self` to `other`, in forward order."""
        if not isinstance(other, Plan):
            raise ValueError(f"can only diff against a Plan, got {type(other).__name__}")
        keys = sorted(set(self._table) | set(other._table), key=forward_order)
        return [PlanChange(k, self._table.get(k), other._table.get(k)) for k in keys
                if self._table.get(k) is not other._table.get(k)]

    def digest(self) -> str:
        """SHA-256 (hex) of the canonical JSON form: equal plans have equal digests anywhere."""
        return hashlib.sha256(self.to_json(indent=None).encode()).hexdigest()

    # -- efficiency ----------------------------------------------------------------------------

    def fp4_fraction(self, flops: "Mapping[LayerKey, float]") -> float:
        """Fraction of this plan's linear FLOPs that run in FP4, by the FLOP table `flops`."""
        return self.fraction_in(Precision.FP4, flops)

    def fraction_in(self, precision: "Precision | str", flops: "Mapping[LayerKey, float]") -> float:
        """Fraction of this plan's linear FLOPs that run in `precision`."""
        p = Precision.parse(precision)
        table = {parse_key(k): float(v) for k, v in flops.items()}
        missing = [k for k in self._table if k not in table]
        if missing:
            raise ValueError(f"FLOP table lacks {len(missing)} planned linear(s): {_preview(missing)}")
        bad = [k for k in self._table if not table[k] >= 0.0]  # also catches NaN
        if bad:
            raise ValueError(f"FLOP table has negative or NaN entries for: {_preview(bad)}")
        total = sum(table[k] for k in self._table)
        if total <= 0.0:
            raise ValueError("FLOP table sums to zero over the planned linears")
        return sum(table[k] for k, v in self._table.items() if v is p) / total

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain, JSON/YAML-safe dict (see the class docstring)."""
        layers: dict[str, dict[str, str]] = {}
        for key, p in self._table.items():
            layers.setdefault(str(key.layer), {})[key.name] = p.value
        # The oldest version that can hold the plan: a dense GPT plan stays v1, so its digest and
        # older SNIP releases reading it do not change.
        version = 1 if all(k.name in LINEAR_NAMES for k in self._table) else PLAN_FORMAT_VERSION
        return {"version": version, "num_layers": self.num_layers, "layers": layers}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Plan":
        """Inverse of `to_dict`; ValueError on anything malformed (never half-built)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"plan must be a mapping, got {type(data).__name__}")
        version = data.get("version")
        if version not in READABLE_VERSIONS:
            raise ValueError(f"unsupported plan version {version!r}; this SNIP reads versions "
                             f"{', '.join(map(str, READABLE_VERSIONS))}")
        layers = data.get("layers")
        if not isinstance(layers, Mapping):
            raise ValueError("plan 'layers' must be a mapping {layer: {linear name: precision}}")
        items = []
        for layer, linears in layers.items():
            if not isinstance(linears, Mapping):
                raise ValueError(f"plan layer {layer!r} must map linear names to precisions")
            if version == 1 and (unknown := sorted(set(linears) - set(LINEAR_NAMES))):
                raise ValueError(f"plan layer {layer!r}: a version 1 plan holds only {', '.join(LINEAR_NAMES)}, "
                                 f"not {', '.join(map(str, unknown))}; write it as version 2")
            items.extend(((layer, name), p) for name, p in linears.items())
        plan = cls(items)
        declared = data.get("num_layers")
        if declared is not None and declared != plan.num_layers:
            raise ValueError(f"plan declares num_layers={declared!r} but its highest layer is "
                             f"{plan.num_layers}")
        return plan

    def to_json(self, indent: "int | None" = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, separators=None if indent else (",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"plan is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "Plan":
        import yaml

        try:
            data = yaml.safe_load(text)  # safe_load: plans never build Python objects
        except yaml.YAMLError as e:
            raise ValueError(f"plan is not valid YAML: {e}") from None
        return cls.from_dict(data)

    def save(self, path: "str | Path") -> Path:
        """Write JSON, or YAML when the suffix is .yaml/.yml."""
        path = Path(path)
        text = self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json()
        path.write_text(text)
        return path

    @classmethod
    def load(cls, path: "str | Path") -> "Plan":
        """A saved plan (JSON, or YAML for .yaml/.yml); every problem is a ValueError naming the file."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ValueError(f"SNIP plan {path}: no such file; give a plan saved by SNIP (Plan.save, or "
                             f"`python -m snip_megatron.report export RUN_DIR`)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"SNIP plan {path}: cannot be read ({e})") from None
        try:
            return cls.from_yaml(text) if path.suffix in (".yaml", ".yml") else cls.from_json(text)
        except ValueError as e:
            raise ValueError(f"SNIP plan {path}: {e}") from None

    @classmethod
    def load_for(cls, path: "str | Path", model: Model) -> "Plan":
        """`load`, checked against `model` (the file named if it does not fit)."""
        plan = cls.load(path)
        try:
            return plan.check_model(model)
        except ValueError as e:
            raise ValueError(f"SNIP plan {path} does not fit this model: {e}") from None

    # -- compact integer form (one collective to broadcast a plan) ------------------------------

    def to_ids(self, model: Model) -> list[int]:
        """Precision ids (index in `Precision`) over `model`'s keys in forward order; the plan
        must cover them exactly."""
        self.check_model(model)
        order = list(Precision)
        return [order.index(self._table[k]) for k in model_keys(model)]

    @classmethod
    def from_ids(cls, ids: Iterable[int], model: Model) -> "Plan":
        ids = [int(i) for i in ids]
        keys = model_keys(model)
        if len(ids) != len(keys):
            raise ValueError(f"expected {len(keys)} precision ids for {_describe(model)}, got {len(ids)}")
        order = list(Precision)
        bad = [i for i in ids if not 0 <= i < len(order)]
        if bad:
            raise ValueError(f"unknown precision id(s) {sorted(set(bad))}; valid: 0..{len(order) - 1}")
        return cls(zip(keys, (order[i] for i in ids)))


def _preview(items: list, limit: int = 6) -> str:
    shown = ", ".join(str(x) for x in items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
