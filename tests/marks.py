"""Reading the suite's own marks and calls from its source (ast, nothing imported): which test
modules carry a pytest mark, what they import, and which test functions start processes.

For tests/test_compat_marks.py and tests/test_launch_marks.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

SUBPROCESS_CALLS = {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}
OS_CALLS = {"system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execlp", "spawnv", "spawnl"}
MULTIPROCESSING_CALLS = {"Process", "spawn", "start_processes", "Pool"}
LAUNCHER_NAMES = {"run_distributed", "run_python"}
"""Called by name: tests/distributed.py's launchers (torchrun's, one process)."""


def module_name(path: Path, root: "Path | None" = None) -> str:
    """The dotted name of a source file under `root` (default: the repository)."""
    parts = path.relative_to(root or ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def suite_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _dotted(node: ast.AST) -> str:
    """`a.b.c` of a Name/Attribute chain ("" for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def uses_mark(tree: ast.AST, mark: str) -> bool:
    """Whether `pytest.mark.<mark>` appears anywhere in the module (decorator, pytestmark, param)."""
    return any(_dotted(node) == f"pytest.mark.{mark}" for node in ast.walk(tree))


def imported_modules(tree: ast.AST, name: str) -> set[str]:
    """Every module the source imports, at its top or inside a function: `from a.b import c` gives
    a.b and a.b.c (c may be a module); relative imports resolved against `name`."""
    package = name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + [base]).rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


# -- which test functions start processes -----------------------------------------------------------

def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it stands for: `import subprocess as sp` (sp -> subprocess), `from
    subprocess import run` (run -> subprocess.run), `from tests.x import f` (f -> tests.x.f)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _is_launcher(target: str) -> bool:
    head, _, attr = target.rpartition(".")
    return (target.rsplit(".", 1)[-1] in LAUNCHER_NAMES
            or (head == "subprocess" and attr in SUBPROCESS_CALLS)
            or (head == "os" and attr in OS_CALLS)
            or (head.split(".")[-1] == "multiprocessing" and attr in MULTIPROCESSING_CALLS))


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Top-level functions and the methods of top-level classes (as Class.method)."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            out.update({f"{node.name}.{n.name}": n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))})
    return out


def _is_fixture(func: ast.FunctionDef) -> bool:
    for dec in func.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if _dotted(target) in ("pytest.fixture", "fixture"):
            return True
    return False


def _fixture_name(func: ast.FunctionDef) -> str:
    for dec in func.decorator_list:
        if isinstance(dec, ast.Call) and _dotted(dec.func) in ("pytest.fixture", "fixture"):
            for kw in dec.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    return kw.value.value
    return func.name


class Launches:
    """Which functions of the suite's modules start processes, directly or through each other:
    by a call (a launcher, or a launching function of this or another tests module) or, for
    tests and fixtures, by a fixture they take (from their module or a conftest.py above it)."""

    def __init__(self, paths: "list[Path] | None" = None):
        paths = paths if paths is not None else sorted(TESTS.rglob("*.py"))
        self.trees = {module_name(p): (p, parse(p)) for p in paths}
        self.functions = {m: _functions(tree) for m, (_, tree) in self.trees.items()}
        self.launching: set[str] = set()  # qualified names: module.function
        self._solve()

    def _calls(self, module: str, aliases: dict, func: ast.AST) -> set[str]:
        local = self.functions[module]
        out = set()
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            dotted = _dotted(node.func)
            if not dotted:
                continue
            head, _, rest = dotted.partition(".")
            if head in aliases:
                out.add(aliases[head] + ("." + rest if rest else ""))
            elif dotted in local or head in local:
                out.add(f"{module}.{dotted}")
            else:
                out.add(dotted)
        return out

    def _fixtures_seen(self, module: str) -> dict[str, str]:
        """Fixture name -> qualified function, for a test module: conftest.py files from tests/
        down to its folder, then its own (the nearest wins)."""
        path = self.trees[module][0]
        chain = [p / "conftest.py" for p in reversed(path.parents) if p == TESTS or TESTS in p.parents]
        out = {}
        for source in [*chain, path]:
            name = module_name(source)
            if name not in self.trees:
                continue
            for qual, func in self.functions[name].items():
                if _is_fixture(func):
                    out[_fixture_name(func)] = f"{name}.{qual}"
        return out

    def _solve(self) -> None:
        edges: dict[str, set[str]] = {}
        for module, (path, tree) in self.trees.items():
            fixtures = self._fixtures_seen(module) if path.name.startswith(("test_", "conftest")) else {}
            aliases = _aliases(tree)
            for qual, func in self.functions[module].items():
                deps = self._calls(module, aliases, func)
                deps |= {fixtures[a.arg] for a in func.args.args if a.arg in fixtures}
                edges[f"{module}.{qual}"] = deps
        changed = True
        while changed:
            changed = False
            for name, deps in edges.items():
                if name not in self.launching and any(_is_launcher(d) or d in self.launching for d in deps):
                    self.launching.add(name)
                    changed = True

    def unmarked(self, mark: str = "launches") -> list[str]:
        """Test functions of test_*.py files that start processes without carrying `mark` (on the
        function, its class or the module's pytestmark)."""
        out = []
        for module, (path, tree) in self.trees.items():
            if not path.name.startswith("test_"):
                continue
            module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                                and uses_mark(n, mark) for n in tree.body)
            for node in tree.body:
                funcs = [(node.name, node, False)] if isinstance(node, ast.FunctionDef) else []
                if isinstance(node, ast.ClassDef):
                    class_marked = any(uses_mark(d, mark) for d in node.decorator_list)
                    funcs = [(f"{node.name}.{n.name}", n, class_marked) for n in node.body if isinstance(n, ast.FunctionDef)]
                for qual, func, class_marked in funcs:
                    if not func.name.startswith("test_") or f"{module}.{qual}" not in self.launching:
                        continue
                    if not (module_marked or class_marked or any(uses_mark(d, mark) for d in func.decorator_list)):
                        out.append(f"{path.relative_to(ROOT)}::{qual}")
        return sorted(out)
