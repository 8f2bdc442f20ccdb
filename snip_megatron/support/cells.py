"""Each cell of the support matrix marked: tested (the tests that run it), refused (the rules that
refuse it, evaluated on the cell's settings), not reachable (why the entry cannot express it), or
unknown (none of these: a gap the tests must close).

The rules are evaluated as this machine's tests see them: no CUDA (so Mamba/GDN kernels are refused
here), Transformer Engine through the test double wherever a cell asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from snip_megatron.support import matrix

TESTED, REFUSED, UNREACHABLE, UNKNOWN = "tested", "refused", "not reachable", "unknown"


@dataclass(frozen=True)
class Mark:
    kind: str
    detail: tuple[str, ...] = ()
    """The tests (tested), the rules (refused), the reason (not reachable)."""


def cell_settings(entry: str, model: str, backend: str, layout: str):
    """The Settings of the cell's representative run, as the entry whose rules apply sees it."""
    from snip_megatron.support.example import settings

    values = {**matrix.MODELS[model][1], **matrix.BACKENDS[backend][1], **matrix.LAYOUTS[layout][1]}
    values.setdefault("run.cuda", False)
    if layout == "tp" and backend != "emulated":
        values["model.sequence_parallel"] = True
    return settings(values, entry)


def unreachable(entry: str, model: str, backend: str, layout: str) -> "str | None":
    for axis, name in (("model", model), ("backend", backend), ("layout", layout)):
        why = matrix.UNREACHABLE.get((entry, axis, name))
        if why is not None:
            return why
    why = matrix.UNREACHABLE.get((entry, "model", model, backend))
    if why is not None:
        return why
    if layout in matrix.EXPERT_LAYOUTS and not matrix.MODELS[model][1].get("model.num_moe_experts"):
        return "a model without experts has no expert parallelism"
    return None


def refused_by(entry: str, model: str, backend: str, layout: str) -> tuple[str, ...]:
    """The names of the rules that refuse the cell (export's: the model x backend rules that name it;
    it reads a plan and starts nothing)."""
    from snip_megatron.support.check import holding

    s = cell_settings(entry, model, backend, layout)
    return tuple(rule.name for rule, _ in holding(s) + holding(s, resolved=True))


def tests_of(entry: str, model: str, backend: str, layout: str) -> tuple[str, ...]:
    return tuple(run.test for run in matrix.TESTED if run.entry == entry and model in run.models
                 and run.backend == backend and layout in run.layouts)


def mark(entry: str, model: str, backend: str, layout: str) -> Mark:
    why = unreachable(entry, model, backend, layout)
    if why is not None:
        return Mark(UNREACHABLE, (why,))
    rules = refused_by(entry, model, backend, layout)
    if rules:
        return Mark(REFUSED, rules)
    tests = tests_of(entry, model, backend, layout)
    return Mark(TESTED, tests) if tests else Mark(UNKNOWN)


def all_marks() -> dict:
    """{(entry, model, backend, layout): Mark} over the whole matrix."""
    return {(e, m, b, lay): mark(e, m, b, lay) for e in matrix.ENTRIES for m in matrix.MODELS
            for b in matrix.BACKENDS for lay in matrix.LAYOUTS}


def counts(marks: dict) -> dict:
    out = {kind: 0 for kind in (TESTED, REFUSED, UNREACHABLE, UNKNOWN)}
    for m in marks.values():
        out[m.kind] += 1
    return out
