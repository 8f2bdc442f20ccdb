"""Placeholder for `transformer_engine.pytorch.GroupedLinear` (MoE expert GEMMs, TE 2.14
`module/grouped_linear.py`). Megatron subclasses it at import (TEGroupedLinear), so the class must
exist; the double does not model grouped GEMMs and refuses to build one."""

from __future__ import annotations

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule


class GroupedLinear(TransformerEngineBaseModule):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("transformer_engine test double: GroupedLinear (MoE grouped "
                                  "GEMMs) is not modelled")
