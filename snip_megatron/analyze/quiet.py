"""snip-analyze's output is its own: what the loop prints while it loads and measures (Megatron's
argument table, its INFO and WARNING logs, its timing lines, Python warnings; Bridge's alike) is
held back, and SNIP's own lines ("[snip] ...") pass. Held lines are shown on stderr only where the
load or the measurement fails unexpectedly (not on bad input, which is one line); `-v` shows
everything as it comes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings

OURS = "[snip"
"""The start of the lines that pass: SNIP's ("[snip] ...") and snip-analyze's."""
SHOWN = 80
"""Held lines shown where the loop fails (its last ones: the traceback and what led to it)."""


class HeldStream(io.TextIOBase):
    """A text stream that passes whole lines starting with OURS to `real` and holds the others
    (everything passes once `release`d: a logger that kept this stream writes through after)."""

    def __init__(self, real):
        self.real, self.held, self._partial, self.passing = real, [], "", False

    def write(self, text: str) -> int:
        if self.passing:
            return self.real.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.startswith(OURS):
                self.real.write(line + "\n")
            else:
                self.held.append(line)
        return len(text)

    def flush(self) -> None:
        self.real.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def release(self) -> list[str]:
        """Pass everything from now on; the lines held so far."""
        self.passing = True
        return self.held + ([self._partial] if self._partial else [])


@contextlib.contextmanager
def held_output(verbose: bool = False):
    """Hold the loop's own output inside the block (nothing held when `verbose`); an exception other
    than bad input (ValueError) shows what was held on stderr before it propagates."""
    if verbose:
        yield
        return
    real_out, real_err = sys.stdout, sys.stderr
    out, err = HeldStream(real_out), HeldStream(real_err)
    sys.stdout, sys.stderr = out, err
    logging.disable(logging.WARNING)  # Megatron's INFO and WARNING records; errors still show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except ValueError:
        raise
    except BaseException:
        held = out.release() + err.release()
        if held:
            skipped = f" (its last {SHOWN} lines; -v shows all)" if len(held) > SHOWN else ""
            print("\n".join([f"[snip-analyze] the loop's output before it stopped{skipped}:", *held[-SHOWN:]]),
                  file=real_err, flush=True)
        raise
    finally:
        sys.stdout, sys.stderr = real_out, real_err
        out.release(), err.release()
        logging.disable(logging.NOTSET)
