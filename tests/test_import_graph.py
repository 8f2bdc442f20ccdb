"""The arrows run one way (model -> stats -> estimate -> planner -> plan -> model): each rule below
names a part of the package and the parts it must never import, at module level or inside a
function. Read from the source with ast, so a lazy import breaks a rule as surely as a top one.
Between files no import circle closes (lazy imports count), and no file grows past MAX_LINES."""

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

MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, name: "str | None" = None) -> list[tuple[str, list[str]]]:
    """(module, the names taken from it) of every import of the file, at its top or inside a
    function; relative imports resolved."""
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).rstrip(".")
            found.append((base, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return found


def _imports(path: Path, name: "str | None" = None) -> set[str]:
    return {m for m, _ in _imported(path, name) if m.startswith("snip_megatron.")}


def _file_imports(path: Path, modules: set[str], name: "str | None" = None) -> set[str]:
    """The package's files `path` imports: `from a.b import c` is the file a/b/c.py where that is a
    module, else a/b (its __init__.py); a file's own parent packages, which Python imports first
    whatever the file says, count only where named."""
    name = name or _module_name(path)
    found = set()
    for base, names in _imported(path, name):
        found.update([f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names] or [base])
    return {m for m in found if m in modules and m != name}


def import_circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one file (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(frozenset(component))
    return circles


def package_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _file_imports(path, set(files)) for name, path in files.items()}


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


def test_no_import_circle_between_files():
    circles = [sorted(c) for c in import_circles(package_graph())]
    assert not circles, f"import circles between files (move what both need to its owner): {circles}"


def test_circles_are_found_with_lazy_imports_and_packages(tmp_path):
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p": {"p.d"}}
    assert import_circles(graph) == [frozenset({"p.a", "p.b", "p.c"})]
    lazy = tmp_path / "x.py"
    lazy.write_text("from snip_megatron.formats import spec, Precision\n\ndef f():\n    import snip_megatron.plan\n")
    found = _file_imports(lazy, {"snip_megatron.formats", "snip_megatron.formats.spec", "snip_megatron.plan"},
                          name="snip_megatron.x")
    assert found == {"snip_megatron.formats", "snip_megatron.formats.spec", "snip_megatron.plan"}


def test_no_file_over_max_lines():
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {f: n for f, n in lengths.items() if n > MAX_LINES}
    assert not over, f"files over {MAX_LINES} lines (split them by the job of their parts): {over}"
