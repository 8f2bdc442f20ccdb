"""The model-family adapters by name (the family an Inventory records)."""

from __future__ import annotations

from types import ModuleType

from snip_megatron.models import gpt, hybrid

ADAPTERS: dict[str, ModuleType] = {gpt.FAMILY: gpt, hybrid.FAMILY: hybrid}


def adapter(family: str) -> ModuleType:
    """The adapter module of `family`; ValueError listing the known ones."""
    try:
        return ADAPTERS[family]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model family {family!r}; SNIP plans {', '.join(ADAPTERS)}") from None
