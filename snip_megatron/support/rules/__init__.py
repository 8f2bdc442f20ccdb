"""Every rule of what SNIP cannot serve, once: grouped by what they are about."""

from __future__ import annotations

from snip_megatron.support.rules import analyze, features, models, moe, precision, te

RULES = precision.RULES + te.RULES + features.RULES + models.RULES + moe.RULES + analyze.RULES
BY_NAME = {rule.name: rule for rule in RULES}
if len(BY_NAME) != len(RULES):  # a rule's name is its id in docs/support.md and the matrix
    raise ImportError("two support rules share a name")
