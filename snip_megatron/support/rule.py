"""Rule: one thing SNIP cannot serve, written once: when it holds, why, and the fix.

A rule reads `Settings` (support.settings) and says its reason in a template whose names each entry
spells its own way (support.names):

    {n[model.fp8]}                 the setting's name: --fp8-format, model.fp8, ...
    {v[model.fp8]}                 its value (`!r` for its repr)
    {nv[model.fp8]}                the setting as the user set it: "--fp8-format e4m3", "model.fp8='e4m3'"
    {drop[model.fp8]}              how to turn it off: "drop --fp8-format", "set model.fp8=None"
    {set[model.sequence_parallel]:True}   how to set it: "--sequence-parallel", "model.sequence_parallel=True"
    {x[sizes]}                     a value the rule's condition computed (`when` returned a dict)
    {nx[lead]}                     the name of the settings path the condition put under `lead`

`example` is a set of values that makes the rule hold on top of the model shape's defaults: the
tests refuse it through every entry that reaches it, and docs/support.md lists it.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any, Callable

from snip_megatron.support.settings import ENTRIES, Settings


@dataclass(frozen=True)
class Rule:
    name: str
    """A short id, stable across releases (docs/support.md and the matrix cite it)."""
    reads: tuple[str, ...]
    """The settings the rule names, the one the user changes first."""
    when: Callable[[Settings], Any]
    """Holds (truthy) for a run SNIP cannot serve; a dict also gives the message its `x` values."""
    says: str
    """Why, as a template (module docstring)."""
    fix: str
    """What to change, as a template."""
    example: dict = field(default_factory=dict)
    """Settings (path -> value) that make the rule hold; `run.*` paths set the run's facts."""
    entries: tuple[str, ...] = ENTRIES
    """The entries the rule applies to (a loop-specific limit names its loop)."""
    after_resolve: bool = False
    """Checked once the SNIP config is resolved for the backend and GPU (the formats it will run)."""

    def holds(self, settings: Settings) -> "dict | None":
        """The rule's message values when it holds for `settings`, else None."""
        entry = settings.run.entry
        if entry not in self.entries and not (entry == "analyze" and "megatron-lm" in self.entries):
            return None
        found = self.when(settings)
        if not found:
            return None
        return found if isinstance(found, dict) else {}

    def text(self, settings: Settings, names, extra: "dict | None" = None) -> str:
        """The one line an entry prints: the reason and the fix, in the entry's names."""
        views = dict(n=_View(names.name), v=_View(lambda p: settings.get(p)),
                     drop=_View(lambda p: names.drop(p, settings.get(p))),
                     set=_View(lambda p: _Setter(names, p)), x=extra or {},
                     nx=_View(lambda k: names.name((extra or {})[k])),
                     nv=_View(lambda p: names.set(p, str(settings.get(p)))))
        return f"{_render(self.says, views)}; {_render(self.fix, views)}"

    def placeholders(self) -> set[str]:
        """Every settings path the templates name (tests check each against the configs)."""
        out = set()
        for template in (self.says, self.fix):
            for _, name, _, _ in string.Formatter().parse(template):
                if name and "[" in name and not name.startswith(("x[", "nx[")):
                    out.add(name[name.index("[") + 1:-1])
        return out


class _View:
    """`view[path]` for str.format's `{view[path]}`."""

    def __init__(self, get):
        self._get = get

    def __getitem__(self, path):
        return self._get(path)


class _Setter:
    """`{set[path]:VALUE}`: the entry's way of setting `path` to VALUE."""

    def __init__(self, names, path):
        self.names, self.path = names, path

    def __format__(self, literal: str) -> str:
        return self.names.set(self.path, literal)


def _render(template: str, views: dict) -> str:
    return template.format(**views)
