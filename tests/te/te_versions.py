"""Make the TE test double stand in for another Transformer Engine version, and the PYTHONPATH of a
process that runs over the doubles.

The double's version is the first `transformer-engine` distribution on sys.path
(importlib.metadata.version, and so `transformer_engine.__version__` and Megatron's
`get_te_version()`): `tests/te_double/transformer_engine-2.14.0.dist-info` unless a folder from
`te_version_folder("2.16.0")` comes before `tests/te_double`:

    folder = te_version_folder("2.16.0", tmp_path)
    env["PYTHONPATH"] = double_pythonpath(te_version=folder)   # repo:folder:tests/te_double

The version takes effect at import, so set it for a new process. What follows it is listed in
`tests/te_double/transformer_engine/_double.py` (the `custom_recipes` layout; behaviour stays TE
2.14's). Imports nothing from TE or Megatron, so the test process itself stays TE-free.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
TE_DOUBLE = ROOT / "tests" / "te_double"
APEX_DOUBLE = ROOT / "tests" / "apex_double"


def te_version_folder(version: str, parent: "str | os.PathLike | None" = None) -> Path:
    """A new folder (under `parent`, or a new temporary one) holding only
    `transformer_engine-<version>.dist-info` (METADATA: Name: transformer-engine, Version: version)."""
    folder = Path(tempfile.mkdtemp(prefix=f"te-{version}-", dir=parent))
    info = folder / f"transformer_engine-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: transformer-engine\nVersion: {version}\n"
        f"Summary: Version metadata for the Transformer Engine test double (tests only).\n")
    (info / "top_level.txt").write_text("transformer_engine\n")
    return folder


def double_pythonpath(*, te_version: "Optional[str | os.PathLike]" = None, apex: bool = False) -> str:
    """PYTHONPATH for a process over the doubles: the repository, the `te_version` folder (from
    `te_version_folder`) if any, tests/apex_double if `apex`, then tests/te_double."""
    parts = [str(ROOT)]
    if te_version is not None:
        parts.append(str(te_version))
    if apex:
        parts.append(str(APEX_DOUBLE))
    parts.append(str(TE_DOUBLE))
    return os.pathsep.join(parts)
