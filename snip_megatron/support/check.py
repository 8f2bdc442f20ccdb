"""The rules applied to one run: what an entry prints and what the support matrix records."""

from __future__ import annotations

from snip_megatron.support.rules import RULES
from snip_megatron.support.settings import Settings


def holding(settings: Settings, *, resolved: bool = False) -> list:
    """[(rule, its message values)] of every rule that holds for `settings`: the rules on the
    configs, or with `resolved` the rules on the SNIP config resolved for the backend and GPU."""
    out = []
    for rule in RULES:
        if rule.after_resolve != resolved:
            continue
        found = rule.holds(settings)
        if found is not None:
            out.append((rule, found))
    return out


def refusals(settings: Settings, names, *, resolved: bool = False) -> list[str]:
    """Every rule that holds, one line each in the entry's names (`names`: support.names)."""
    lines = []
    for rule, found in holding(settings, resolved=resolved):
        line = rule.text(settings, names, found)
        if line not in lines:
            lines.append(line)
    return lines


def refusal_message(head: str, lines: list[str]) -> str:
    """The one error an entry raises: `head` ("this Megatron-LM run cannot take SNIP as
    configured") and every refusal, on one line when there is one."""
    if len(lines) == 1:
        return f"{head}: {lines[0]}"
    return f"{head}:\n  - " + "\n  - ".join(lines)
