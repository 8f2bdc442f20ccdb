"""Run a script's `check_*` functions in one process and write {name: "ok" | traceback} as JSON.

The TE double may only be imported in subprocesses (Megatron caches HAVE_TE at import), so the
TE checks run in scripts and tests/te/test_te_double.py asserts on what they wrote.
"""

from __future__ import annotations

import argparse
import json
import traceback


def run_checks(namespace: dict, description: str, setup=None) -> None:
    """Parse --out FILE [--only NAMES], call `setup()` once, then every check_* of `namespace` in
    order (or only those named)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    args = parser.parse_args()
    only = None if args.only is None else set(args.only.split(","))
    results: dict = {}
    if setup is not None:
        setup()
    for name, check in namespace.items():
        if not (name.startswith("check_") and callable(check)) or (only is not None and name not in only):
            continue
        try:
            data = check()
            results[name] = "ok"
            if data is not None:
                results[f"{name}.data"] = data
        except Exception:  # one failing check must not hide the others
            results[name] = traceback.format_exc()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
