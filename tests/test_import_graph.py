"""The arrows run one way (model -> stats -> estimate -> planner -> plan -> model): each rule below
names a part of the package and the parts it must never import, at module level or inside a
function. Read from the source with ast, so a lazy import breaks a rule as surely as a top one."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "snip_megatron"
ALIASES = {"snip_megatron.megatron.pretrain_gpt"}
"""Thin aliases kept for old entry points (they re-export another part and hold no code)."""

RULES = {
    # part: parts it must not import
    "formats": {"emulation", "te", "stats", "estimate", "planner", "plan", "controller", "megatron", "train",
                "pretrain", "cli", "bridge", "config", "report"},
    # model-family adapters: below the plan (it keys by their inventory), Megatron only inside functions
    "models": {"emulation", "te", "stats", "estimate", "planner", "plan", "controller", "megatron", "train",
               "pretrain", "cli", "bridge", "config", "report"},
    "plan": {"emulation", "te", "stats", "estimate", "planner", "controller", "megatron", "train", "pretrain",
             "cli", "bridge", "config", "report"},
    "emulation": {"te", "stats", "estimate", "planner", "controller", "train", "pretrain", "cli", "bridge"},
    "te": {"emulation", "stats", "estimate", "planner", "controller", "megatron", "train", "pretrain", "cli",
           "bridge"},
    "megatron": {"controller", "stats", "estimate", "planner", "cli", "train", "pretrain", "bridge", "report"},
    "stats": {"estimate", "planner", "controller", "train", "pretrain", "cli", "bridge", "report"},
    "estimate": {"planner", "controller", "megatron", "emulation", "train", "pretrain", "cli", "bridge"},
    "planner": {"estimate", "stats", "controller", "megatron", "emulation", "te", "train", "pretrain", "cli",
                "bridge"},
    "controller": {"train", "pretrain", "cli", "bridge", "megatron"},
    "report": {"controller", "stats", "estimate", "train", "pretrain", "cli", "megatron"},
    "train": {"pretrain", "cli", "bridge"},
    "pretrain": {"train", "cli", "bridge"},
    "bridge": {"train", "cli"},  # Bridge's loop builds on the Megatron-LM one's pieces, not the compact loop
    "analyze": {"cli"},  # a tool on top of both loops, beside the recipe CLI
}
"""The two training loops (train, pretrain) sit side by side; adapters (megatron) never reach up to
the controller, the measurement or the CLI; planner and estimate never import each other."""
TOOLS = {"analyze"}
"""Tools on top of the loops (snip-analyze): no other part imports them."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: "str | None" = None) -> set[str]:
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).rstrip(".")
            found.add(base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("snip_megatron.")}


def _part(module: str) -> str:
    return module.split(".")[1]


def test_every_part_the_rules_name_exists():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("__")}
    assert set(RULES) <= parts


@pytest.mark.parametrize("part", sorted(RULES))
def test_arrows_run_one_way(part):
    files = [PACKAGE / f"{part}.py"] if (PACKAGE / f"{part}.py").exists() else sorted((PACKAGE / part).rglob("*.py"))
    broken = []
    for path in files:
        if _module_name(path) in ALIASES:
            continue
        for target in sorted(_imports(path)):
            if _part(target) in RULES[part] or (_part(target) in TOOLS and part not in TOOLS):
                broken.append(f"{_module_name(path)} imports {target}")
    assert not broken, "\n".join(broken)


def test_a_lazy_or_relative_import_is_seen(tmp_path):
    wrong = tmp_path / "x.py"
    wrong.write_text("from . import exact\n\ndef f():\n    from snip_megatron.estimate.cost import cost_table\n")
    found = _imports(wrong, name="snip_megatron.planner.x")
    assert found == {"snip_megatron.planner", "snip_megatron.estimate.cost"}
    assert _part("snip_megatron.estimate.cost") in RULES["planner"]
