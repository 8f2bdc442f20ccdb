"""patches/megatron-lm-pretrain_gpt.patch: a well-formed diff, and every plugin name it calls
exists with the signature it is called with (the patched script itself runs in test_runs.py)."""

import ast
import inspect
import re

from tests.distributed import ROOT


# -- patches/megatron-lm-pretrain_gpt.patch: well formed, and every plugin name it calls exists ------

PATCH = ROOT / "patches" / "megatron-lm-pretrain_gpt.patch"


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


def test_patch_is_a_unified_diff_of_pretrain_gpt():
    text = PATCH.read_text()
    assert text.startswith("--- a/pretrain_gpt.py\n+++ b/pretrain_gpt.py\n")
    found = hunks(text)
    assert len(found) == 3
    for header, body in found:  # every hunk's line counts match its header
        old_start, old_len, new_start, new_len = map(int, re.match(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@", header).groups())
        assert sum(1 for b in body if b[:1] in (" ", "-")) == old_len, header
        assert sum(1 for b in body if b[:1] in (" ", "+")) == new_len, header


def test_every_plugin_name_the_patch_uses_exists():
    code = added(PATCH.read_text())
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


def test_patch_only_touches_what_it_says():
    text = PATCH.read_text()
    removed = [line for line in text.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert removed == ["-        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,"]
