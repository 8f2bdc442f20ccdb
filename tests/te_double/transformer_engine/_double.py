"""The version of TE this double stands in for (the double's own module; TE has none like it).

Read once, at import, from the first `transformer-engine` distribution on sys.path, as
importlib.metadata finds it: `tests/te_double/transformer_engine-2.14.0.dist-info` unless a test
puts a folder made by `tests/te/te_versions.py` before `tests/te_double`. Three things follow the
version: `transformer_engine.__version__` (what Megatron's `get_te_version()` reads), the layout of
`pytorch.custom_recipes` (see its `__init__`) and the recipe fields TE reads from its environment
(`common/recipe`); the linears behave as TE 2.14's.
"""

from __future__ import annotations

import re
from importlib import metadata

VERSION = str(metadata.version("transformer-engine"))


def version_tuple(version: str = VERSION) -> tuple[int, int]:
    """(major, minor) of a version string such as "2.16.0" or "2.9.0+70f5366"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"transformer_engine test double: version {version!r} is not a version number")
    return int(match.group(1)), int(match.group(2))
