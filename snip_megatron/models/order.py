"""The canonical forward order of planned linears, for keys without an inventory at hand (pure).

Within a layer, linears sort by their position in the forward pass of whichever model family
has them; every adapter registers its names here, in its order (a test checks each inventory is
already in this order), so a plan's order and digest do not depend on how it was built.
"""

from __future__ import annotations

from snip_megatron.models import gpt
from snip_megatron.models.keys import LayerKey

_RANK = {name: i for i, name in enumerate(dict.fromkeys(gpt.LINEAR_NAMES))}


def forward_order(key: LayerKey) -> tuple[int, int, str]:
    """Sort key: layer, then the linear's position in the forward pass (unknown names last, by name)."""
    return key.layer, _RANK.get(key.name, len(_RANK)), key.name
