"""The start-up checks of SNIP's seams into Megatron (the table: snip_megatron/megatron/seams.py).

    python -m snip_megatron.megatron.seam_check [--loop megatron-lm|bridge|core|all]
        [--megatron-root DIR] [--write-doc]

checks the Megatron importable here (PYTHONPATH may point at a Megatron-LM checkout:
scripts/check_megatron_drift.sh, which gives --megatron-root so that the Megatron checked is
that checkout's, not an installed one), prints one line per seam, and exits 1 when any fails.
"""

from __future__ import annotations

import argparse
import dis
import importlib
import inspect
import os
import sys
import types
from pathlib import Path

from snip_megatron.megatron.seams import LOOPS, Seam, document, of_loop

DOC = Path(__file__).resolve().parents[2] / "docs" / "seams.md"


def versions(loop: str = "core") -> str:
    """"megatron-core 0.19.2" (and ", megatron-bridge X" for Bridge's loop): the versions checked."""
    out = []
    for package, module in (("megatron-core", "megatron.core"), ("megatron-bridge", "megatron.bridge")):
        if package == "megatron-bridge" and loop not in ("bridge", "all"):
            continue
        try:
            version = getattr(importlib.import_module(module), "__version__", "unknown")
        except Exception:  # noqa: BLE001 - absent or broken: said as such
            version = "not importable"
        out.append(f"{package} {version}")
    return ", ".join(out)


def resolve(target: str):
    """The object at "module:qualname", or None where an attribute is missing (an ImportError where
    the module is). A class attribute set only in __init__ (a router's router_replay) resolves to
    its class."""
    module_name, qualname = target.split(":")
    obj = importlib.import_module(module_name)
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        found = getattr(obj, part, None)
        if found is None:
            return obj if i == len(parts) - 1 and isinstance(obj, type) and _set_in_init(obj, part) else None
        obj = found
    return obj


def _set_in_init(cls: type, attribute: str) -> bool:
    return attribute in _names(cls.__init__, ("STORE_ATTR",))


def _names(fn, opnames: tuple) -> set:
    """The names `fn`'s bytecode (nested functions included) uses with one of `opnames`."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    found, stack = set(), [code] if code is not None else []
    while stack:
        code = stack.pop()
        found.update(i.argval for i in dis.get_instructions(code) if i.opname in opnames)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return found


def problems(seam: Seam) -> list:
    """What no longer holds for `seam` in the Megatron importable here ([] when all of it does)."""
    try:
        target = resolve(seam.target)
    except Exception as e:  # noqa: BLE001 - an import that fails here, for whatever reason
        return [f"{seam.module} cannot be imported ({type(e).__name__}: {e})"]
    if target is None:
        return [f"{seam.dotted} does not exist; SNIP's use: {seam.use}"]
    out = []
    if seam.params:
        fn = inspect.unwrap(target)
        have = tuple(inspect.signature(fn).parameters)
        if (have if seam.exact else have[:len(seam.params)]) != seam.params:
            shown = have if seam.exact else have[:len(seam.params)]
            more = "" if seam.exact else ", ..."
            out.append(f"{seam.dotted} takes ({', '.join(shown)}{more}); snip-megatron was written for "
                       f"({', '.join(seam.params)}{more})")
    module = importlib.import_module(seam.module)
    for caller in seam.called_by:
        fn = resolve(caller)
        if fn is None or seam.name not in _names(fn, ("LOAD_GLOBAL", "LOAD_NAME")) \
                or inspect.unwrap(fn).__globals__ is not vars(module):
            out.append(f"{caller.replace(':', '.')} no longer looks {seam.name} up in {seam.module}, so SNIP's "
                       f"wrapper there would never run")
    for reader in seam.read_by:
        fn = resolve(reader)
        if fn is None or seam.name not in _names(fn, ("LOAD_ATTR", "LOAD_METHOD")):
            out.append(f"{reader.replace(':', '.')} no longer reads .{seam.name}, so what SNIP puts there "
                       "would never be used")
    if seam.keywords_of:
        from snip_megatron.emulation.forward_impl import check_keywords, keywords_passed

        forward = resolve(seam.keywords_of)
        passed = keywords_passed(forward) if forward is not None else None
        if passed is None:
            out.append(f"{seam.keywords_of.replace(':', '.')}: its source cannot be read")
        else:
            try:
                check_keywords(seam.qualname.split(".")[0], passed)
            except TypeError as e:
                out.append(str(e))
    if seam.is_a and type(target).__name__ != seam.is_a:
        out.append(f"{seam.dotted} is a {type(target).__name__}, not a {seam.is_a}")
    return out


def check(loop: str) -> None:
    """RuntimeError listing every seam of `loop` (seams.of_loop) that no longer holds, with the
    Megatron versions; run at start-up, before anything is wrapped."""
    found = [p for seam in of_loop(loop) for p in problems(seam)]
    if found:
        name = {"bridge": "Megatron-Bridge", "megatron-lm": "Megatron-LM"}.get(loop, "Megatron")
        raise RuntimeError(f"snip-megatron cannot join this {name} ({versions(loop)}) safely: " + "; ".join(found)
                           + ". Use a Megatron release snip-megatron supports (docs/seams.md), or update "
                             "snip-megatron")


def _checkout_of(package: str) -> "Path | None":
    """The folder holding the `megatron/` that `package` ("megatron.core") is imported from (as found
    on the path, symbolic links kept), or None where it does not import."""
    try:
        module = importlib.import_module(package)
    except Exception:  # noqa: BLE001 - said by the caller
        return None
    return Path(os.path.abspath(module.__file__)).parents[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m snip_megatron.megatron.seam_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loop", default="megatron-lm", choices=(*LOOPS, "all"),
                   help="whose seams to check: a loop's own and Megatron-Core's (default: megatron-lm)")
    p.add_argument("--megatron-root", type=Path, default=None,
                   help="the folder megatron.core (and, for Megatron-LM's loop, megatron.training) must be "
                        "imported from; exit 2 if they come from elsewhere")
    p.add_argument("--write-doc", action="store_true", help=f"write {DOC.relative_to(DOC.parents[1])} and exit")
    args = p.parse_args(argv)
    if args.write_doc:
        DOC.write_text(document())
        print(f"wrote {DOC}")
        return 0
    root = _checkout_of("megatron.core")
    if args.megatron_root is not None:
        packages = ["megatron.core"] + (["megatron.training"] if args.loop in ("megatron-lm", "all") else [])
        imported = {name: _checkout_of(name) for name in packages}
        elsewhere = [f"{name} from {where or 'nowhere (it does not import)'}" for name, where in imported.items()
                     if where is None or not os.path.samefile(where, args.megatron_root)]
        if elsewhere:
            print(f"--megatron-root {args.megatron_root}: imported {', '.join(elsewhere)} instead; put the "
                  "checkout first on PYTHONPATH", file=sys.stderr)
            return 2
    print(f"checking SNIP's seams against {versions(args.loop)} at {root}")
    failed = 0
    for seam in of_loop(args.loop):
        found = problems(seam)
        failed += bool(found)
        print(f"{'FAIL' if found else 'ok  '} {seam.loop:<11} {seam.dotted}" + "".join(f"\n       {x}" for x in found))
    total = len(of_loop(args.loop))
    print(f"{failed} of {total} seams fail" if failed else f"all {total} seams hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
