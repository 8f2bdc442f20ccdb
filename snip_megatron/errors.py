"""How every command line reports bad input: one line, `<prog>: error: <what, where, the fix>`, exit
status 2, no traceback. `--debug` (taken out of the arguments before they are parsed) or
SNIP_DEBUG=1 shows the traceback instead.

Bad input is a ValueError (or a subclass, such as a checkpoint error) raised with a message that
names the file or the setting and the fix; every loader of a user-facing file raises one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

class MissingDependency(ValueError):
    """A package the user's stack needs is not installed here: one line naming what to install,
    exit status 2, like any bad input."""


DEBUG_ENV = "SNIP_DEBUG"
DEBUG_FLAG = "--debug"


def split_debug(argv: "list[str]") -> "tuple[bool, list[str]]":
    """(whether tracebacks are wanted, the arguments without --debug)."""
    debug = DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    return debug, [a for a in argv if a != DEBUG_FLAG]


def run_cli(prog: str, main: Callable[[list], int], argv: "list[str] | None" = None) -> int:
    """main(argv) with bad input turned into one line on stderr and exit status 2."""
    debug, argv = split_debug(list(sys.argv[1:] if argv is None else argv))
    try:
        return main(argv)
    except ValueError as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
