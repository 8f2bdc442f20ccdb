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


def family_of(model_chunks) -> str:
    """The family of built model chunk(s) (one chunk or a list under VPP): a HybridModel's, else
    the dense GPT's."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return hybrid.FAMILY if any(hybrid.is_model(c) for c in chunks) else gpt.FAMILY
