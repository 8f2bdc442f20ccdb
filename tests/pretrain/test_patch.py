"""patches/megatron-lm-pretrain_gpt.patch and megatron-lm-pretrain_hybrid.patch: each a well-formed
diff, and every plugin name it calls exists with the signature it is called with (the patched GPT
script itself runs in test_runs.py, the hybrid one in test_hybrid_runs.py)."""

import ast
import inspect
import re

import pytest

from tests.distributed import ROOT


# -- patches/megatron-lm-pretrain_gpt.patch: well formed, and every plugin name it calls exists ------

SCRIPTS = ("pretrain_gpt", "pretrain_hybrid")
"""The Megatron-LM scripts a patch adds SNIP to (patches/megatron-lm-<script>.patch)."""


def patch_of(script: str):
    return ROOT / "patches" / f"megatron-lm-{script}.patch"


def hunks(text: str) -> list[tuple[str, list[str]]]:
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("@@"):
            current = (line, [])
            out.append(current)
        elif current is not None:
            current[1].append(line)
    return out


def added(text: str) -> str:
    return "\n".join(line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_patch_is_a_unified_diff_of_its_script(script):
    text = patch_of(script).read_text()
    assert text.startswith(f"--- a/{script}.py\n+++ b/{script}.py\n")
    found = hunks(text)
    assert len(found) == 3
    for header, body in found:  # every hunk's line counts match its header
        old_start, old_len, new_start, new_len = map(int, re.match(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@", header).groups())
        assert sum(1 for b in body if b[:1] in (" ", "-")) == old_len, header
        assert sum(1 for b in body if b[:1] in (" ", "+")) == new_len, header


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_plugin_name_the_patch_uses_exists(script):
    code = added(patch_of(script).read_text())
    imports = [n for n in ast.walk(ast.parse(_imports(code)))
               if isinstance(n, ast.ImportFrom)]
    names = {}
    for node in imports:
        module = __import__(node.module, fromlist=[a.name for a in node.names])
        for alias in node.names:
            assert hasattr(module, alias.name), f"{node.module}.{alias.name} does not exist"
            names[alias.asname or alias.name] = getattr(module, alias.name)
    assert set(names) == {"add_snip_args", "setup_megatron_lm"}
    # Each plugin call in the patch matches the plugin's signature.
    assert "add_snip_args(" in code and "setup_megatron_lm(args, model_cfg)" in code
    inspect.signature(names["add_snip_args"]).bind(object())
    inspect.signature(names["setup_megatron_lm"]).bind(object(), object())


def _imports(code: str) -> str:
    return "\n".join(line for line in code.splitlines() if line.startswith("from snip_megatron"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_patch_only_touches_what_it_says(script):
    text = patch_of(script).read_text()
    removed = [line for line in text.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert removed == ["-        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,"]
