"""docker/Dockerfile against the package: what it copies exists, its smoke lines use only names that
exist, the console scripts it runs are declared. Docker itself is not run here (no daemon, no GPU,
no registry): this is what can be checked without building the image.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import json
import re
import shlex
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from snip_megatron.cli.train import main as snip_train

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / "docker" / "Dockerfile.dockerignore"

# The default base image and what it ships (docker/README.md gives the sources).
NGC_TAG = "nvcr.io/nvidia/pytorch:26.06-py3"
NGC_TORCH = "2.13.0a0+8145d630e8.nv26.06"

# Transformer Engine cannot be installed here, so its names are checked against this table.
# transformer_engine: its __init__.py (v2.16, the 26.06 image's 2.16.0) sets
#   `__version__ = str(metadata.version("transformer_engine"))` and imports `.pytorch` and `.common`.
# transformer_engine.pytorch: the classes and functions of TE's API reference (docs/api/pytorch.rst,
#   release 2.9: Linear ... TransformerLayer, fp8_autocast) plus `autocast` (pytorch/__init__.py,
#   v2.16). It has no `__version__`: the old smoke line `te.pytorch.__version__` would fail.
TE_NAMES = {
    "transformer_engine": {"__version__", "pytorch", "common"},
    "transformer_engine.pytorch": {
        "Linear", "GroupedLinear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP",
        "DotProductAttention", "MultiheadAttention", "TransformerLayer", "fp8_autocast", "autocast",
    },
}
# Present only in megatron-core >= 0.19 (the Dockerfile installs that; the compat lane has 0.16).
MEGATRON_019_ONLY = ("megatron.training",)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


def python_snippets(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r'\bpython3?\s+-c\s+"((?:[^"\\]|\\.)*)"', text)]


def dotted_names(code: str) -> set[str]:
    """Every module, `module.attr` and `from module import name` a snippet relies on."""
    tree = ast.parse(code)
    bound: dict[str, str] = {}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.add(alias.name)
                bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names.add(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = []
            inner = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in bound:
                names.add(".".join([bound[inner.id], *reversed(parts)]))
    return names


def missing(name: str) -> str | None:
    """Why `name` (a module, or an attribute of one) would not resolve in the image; None if it would."""
    parts = name.split(".")
    if parts[0] == "transformer_engine":
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in TE_NAMES:
                rest = parts[cut:]
                if not rest or (len(rest) == 1 and rest[0] in TE_NAMES[module]):
                    return None
                return f"{module} has no documented {'.'.join(rest)}"
        return f"{name} is not a documented Transformer Engine module"
    if name.startswith(MEGATRON_019_ONLY) and Version(metadata.version("megatron-core")) < Version("0.19"):
        # Not importable in this lane; the Dockerfile must then install the release that has it.
        return None if '"megatron-core>=0.19"' in DOCKERFILE.read_text() else f"{name} needs megatron-core>=0.19"
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{module} has no {'.'.join(parts[cut:])}"
            obj = getattr(obj, attr)
        return None
    return f"{name} cannot be imported"


def console_scripts() -> dict[str, str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    entry = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))
    return dict(tuple(part.strip() for part in line.split("=", 1)) for line in entry["console_scripts"])


def commands(text: str) -> list[list[str]]:
    """The commands RUN and CMD start: each shell segment's words, env assignments and braces dropped."""
    found = []
    for op, args in instructions(text):
        if op == "CMD" and args.startswith("["):
            found.append(json.loads(args))
        elif op in ("RUN", "CMD"):
            for segment in re.split(r"&&|\|\||;|\||\bthen\b|\bif\b|\bfi\b", re.sub(r"'[^']*'", "''", re.sub(r'"(?:[^"\\]|\\.)*"', '""', args))):
                words = [w for w in segment.split() if w not in ("{", "}", "!") and not re.match(r"^[A-Z_]+=", w)]
                if words:
                    found.append(words)
    return found


TEXT = DOCKERFILE.read_text()


def test_copied_paths_exist_and_reach_the_context():
    ignore = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    copies = [args.split() for op, args in instructions(TEXT) if op == "COPY"]
    assert copies
    for words in copies:
        sources = [w for w in words[:-1] if not w.startswith("--")]
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"
            assert not any(fnmatch.fnmatch(src, pattern) for pattern in ignore), f"COPY {src} is dockerignored"


def test_context_leaves_out_the_lanes_environments():
    ignore = DOCKERIGNORE.read_text().split()
    for path in (".venv-prod", ".venv-compat", "runs", ".git"):
        assert any(fnmatch.fnmatch(path, pattern) for pattern in ignore), path


def test_smoke_lines_use_only_names_that_exist():
    snippets = python_snippets(TEXT)
    assert len(snippets) >= 3, snippets
    names = set().union(*(dotted_names(code) for code in snippets))
    assert {"transformer_engine.__version__", "megatron.training"} <= names, names
    problems = {name: why for name in sorted(names) if (why := missing(name))}
    assert not problems, problems


@pytest.mark.parametrize("code, problem", [
    ("import transformer_engine.pytorch as te; print(te.__version__)", "transformer_engine.pytorch.__version__"),
    ("import snip_megatron.planner as p; p.no_such_function()", "snip_megatron.planner.no_such_function"),
    ("from snip_megatron.planner.solve import no_such_name", "snip_megatron.planner.solve.no_such_name"),
    ("import snip_megatron.no_such_module", "snip_megatron.no_such_module"),
])
def test_the_check_catches_a_wrong_name(code, problem):
    assert problem in dotted_names(code)
    assert missing(problem) is not None


def test_console_scripts_are_declared_and_resolve():
    declared = console_scripts()
    used = {words[0] for words in commands(TEXT) if words[0].startswith("snip-")}
    assert {"snip-train"} <= used, used
    assert used <= set(declared), used - set(declared)
    for name in used:
        module, func = declared[name].split(":")
        assert callable(getattr(importlib.import_module(module), func)), declared[name]


def test_the_dry_run_it_runs_works(monkeypatch, capsys):
    runs = [words for words in commands(TEXT) if words[0] == "snip-train" and "--dry-run" in words]
    assert runs
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("SNIP_CONFIG_DIR", raising=False)
    for words in runs:
        argv = [w for w in shlex.split(" ".join(words[1:])) if w not in (">", "/dev/null")]
        assert snip_train(argv) == 0, capsys.readouterr().err
        assert "# launch command" in capsys.readouterr().out


def test_base_image_and_its_torch_fit_the_package():
    assert re.search(rf"^ARG BASE_IMAGE={re.escape(NGC_TAG)}$", TEXT, re.M)
    readme = (ROOT / "docker" / "README.md").read_text()
    assert NGC_TAG in readme and NGC_TORCH in readme
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    install = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))
    torch = next(Requirement(r) for r in install if Requirement(r).name == "torch")
    # pip keeps an installed pre-release when the specifier admits it (prereleases=True).
    assert torch.specifier.contains(NGC_TORCH, prereleases=True), str(torch)
