"""docs/support.md is the matrix as generated now, docs/troubleshooting.md lists every rule as the entries
print it now, and every test a tested cell names exists."""

import ast
import re
from pathlib import Path

import pytest

from snip_megatron.support import cells, matrix

ROOT = Path(__file__).resolve().parents[2]


def test_the_support_page_is_current():
    pytest.importorskip("megatron.training.arguments",
                        reason="Megatron-LM's flags (named on the page) come from megatron.training (prod lane)")
    from snip_megatron.support.doc import DOC, document

    assert DOC.read_text() == document(), "docs/support.md is stale: run python -m snip_megatron.support --write"


def test_the_troubleshooting_refusals_are_current():
    pytest.importorskip("megatron.training.arguments",
                        reason="Megatron-LM's flags (named on the page) come from megatron.training (prod lane)")
    from snip_megatron.support.doc import TROUBLESHOOTING, with_refusals

    text = TROUBLESHOOTING.read_text()
    assert with_refusals(text) == text, ("docs/troubleshooting.md's start-up refusals are stale: run "
                                         "python -m snip_megatron.support --write")


def test_every_rule_is_under_a_subject_heading():
    """The refusals are grouped by the rules module that defines them: a new module needs its heading."""
    from snip_megatron.support.doc import SUBJECTS
    from snip_megatron.support.rules import RULES

    assert {rule.when.__module__.rpartition(".")[2] for rule in RULES} <= set(SUBJECTS)


def test_the_generated_part_replaces_only_what_lies_between_the_markers(monkeypatch):
    from snip_megatron.support import doc

    monkeypatch.setattr(doc, "troubleshooting_refusals", lambda: f"{doc.BEGIN}\nnew\n{doc.END}")
    page = f"head\n{doc.BEGIN}\nold\n{doc.END}\ntail"
    assert doc.with_refusals(page) == f"head\n{doc.BEGIN}\nnew\n{doc.END}\ntail"
    with pytest.raises(ValueError, match="markers"):
        doc.with_refusals("no markers here")


def _defined(path: Path) -> set:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_test_a_tested_cell_names_exists():
    for run in matrix.TESTED:
        file, _, name = run.test.partition("::")
        function, _, param = name.partition("[")
        path = ROOT / file
        assert path.is_file(), run.test
        assert function in _defined(path), run.test
        for part in param.rstrip("]").split("-") if param else ():  # a parametrized case: its ids are in the file
            assert re.search(rf"[\"']{re.escape(part)}[\"']|\b{re.escape(part)}\b", path.read_text()), run.test


def test_the_runs_name_the_matrixs_axes():
    for run in matrix.TESTED:
        assert run.entry in matrix.ENTRIES and run.backend in matrix.BACKENDS, run
        assert set(run.models) <= set(matrix.MODELS) and set(run.layouts) <= set(matrix.LAYOUTS), run
        assert ("one" in run.layouts) == (run.layouts == ("one",)), run  # one process combines with nothing


def test_a_cell_is_refused_by_the_rules_not_by_the_matrix():
    """The marks come from the rules: a cell the rules refuse is refused even where a test is named."""
    assert cells.mark("megatron-lm", "moe_local", "emulated", "cp").kind == cells.REFUSED
    assert cells.mark("megatron-lm", "moe_local", "emulated", "cp").detail == ("cp-local-attention",)
    assert cells.mark("compact", "hybrid", "te_hopper", "one").kind == cells.UNREACHABLE
    assert cells.mark("megatron-lm", "dense", "emulated", "one").kind == cells.TESTED
