"""The canonical forward order of planned linears, for keys without an inventory at hand (pure).

Within a layer, linears sort by their position in the forward pass of whichever model family
has them; every adapter registers its names here, in its order (a test checks each inventory is
already in this order), so a plan's order and digest do not depend on how it was built.
"""

from __future__ import annotations

import zlib

from snip_megatron.models import gpt, hybrid
from snip_megatron.models.keys import LayerKey

_RANK = {name: i for i, name in enumerate(dict.fromkeys(gpt.NAMES + hybrid.NAMES))}
_LEGACY_RANK = {name: i for i, name in enumerate(gpt.LINEAR_NAMES)}


def forward_order(key: LayerKey) -> tuple[int, int, int, str]:
    """Sort key: a GPT's multi-token-prediction layers ("mtp.<name>") after every other layer, then
    the layer, then the linear's position in the forward pass (unknown names last, by name)."""
    mtp = key.name.startswith(gpt.MTP)
    base = key.name[len(gpt.MTP):] if mtp else key.name
    rank = -1 if key.name == gpt.MTP_EH_PROJ.name else _RANK.get(base, len(_RANK))
    return int(mtp), key.layer, rank, key.name


_LEGACY = 4  # the dense GPT's linears per layer, the only names before the inventory


def key_index(key: LayerKey) -> int:
    """A distinct non-negative integer per key (random streams are seeded from it).

    A dense GPT's keys keep the value they always had (layer * 4 + position), so seeded noise and
    statistics do not change; other names get their own range, from a hash of the name."""
    rank = _LEGACY_RANK.get(key.name)
    if rank is not None:
        return key.layer * _LEGACY + rank
    return (1 << 40) + key.layer * (1 << 20) + zlib.crc32(key.name.encode()) % (1 << 20)
