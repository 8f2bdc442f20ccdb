"""The compat lane runs only the tests marked `compat` (scripts/run_tests.sh), so the code that
differs between the lanes' pins must be tagged and reached by them:

- every module of snip_megatron/ holding a `# compat:` line (what differs between megatron-core
  0.16 and 0.19, PuLP 3 and 4, torch 2.13 and 2.14) is imported by a compat-marked test module;
- every call of `megatron_core_version()` in snip_megatron/ sits on or right under such a line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.marks import ROOT, imported_modules, module_name, parse, suite_files, uses_mark

PACKAGE = ROOT / "snip_megatron"
TAG = re.compile(r"#\s*compat:")


def tagged_modules(package: Path = PACKAGE) -> set[str]:
    return {module_name(p, package.parent) for p in package.rglob("*.py") if TAG.search(p.read_text())}


def compat_tested(paths: list[Path], root: Path = ROOT) -> set[str]:
    """The modules the compat-marked test files import."""
    out = set()
    for path in paths:
        tree = parse(path)
        if uses_mark(tree, "compat"):
            out |= imported_modules(tree, module_name(path, root))
    return out


def untagged_version_calls(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == \
                    "megatron_core_version":
                here, above = lines[node.lineno - 1], lines[node.lineno - 2] if node.lineno > 1 else ""
                if not (TAG.search(here) or TAG.match(above.strip())):
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_every_compat_tagged_module_is_imported_by_a_compat_test():
    tagged = tagged_modules()
    assert {"snip_megatron.megatron.apply", "snip_megatron.pretrain.entry"} <= tagged  # the scan finds tags
    missing = sorted(tagged - compat_tested(suite_files()))
    assert not missing, f"no test module marked `compat` imports these (mark the tests that exercise them): {missing}"


def test_every_megatron_core_version_call_is_on_or_under_a_compat_line():
    assert not untagged_version_calls(), "add a `# compat:` line saying what differs"


def test_the_checks_catch_an_untagged_call_and_an_untested_tag(tmp_path):
    package = tmp_path / "snip_megatron"
    package.mkdir()
    (package / "a.py").write_text("def f():\n    # compat: 0.16 lacks it\n    return megatron_core_version()\n")
    (package / "b.py").write_text("def g():\n    x = 1\n    return megatron_core_version() > (0, 17)\n"
                                  "def h():\n    return v.megatron_core_version()  # compat: inline\n")
    assert tagged_modules(package) == {"snip_megatron.a", "snip_megatron.b"}
    assert untagged_version_calls(package) == ["snip_megatron/b.py:3"]
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("import pytest\nfrom snip_megatron import a\n\n@pytest.mark.compat\ndef test_a():\n    pass\n")
    (tests / "test_b.py").write_text("import pytest\n\ndef test_b():\n    from snip_megatron.b import g\n")
    tested = compat_tested([tests / "test_a.py", tests / "test_b.py"], root=tmp_path)
    assert "snip_megatron.a" in tested and "snip_megatron.b" not in tested
