"""Start-up notices: one line per expected absence instead of the library warnings about it.

Importing megatron.core on a machine without Transformer Engine or apex prints a dozen
UserWarnings ("Transformer Engine and Apex are not installed. Falling back to ...", once per
optimizer / FSDP / norm module, "absl.logging is not installed ..."), and torch logs "No CUDA
runtime is found, using CUDA_HOME=..." when CUDA_HOME is set on a machine without a GPU. All are
expected on CPU. `quiet_startup()`, which every entry point calls before anything imports
megatron, prints one line for each absent component and filters exactly the warnings that line
replaces: by message (matched at its start), category and the warning module (megatron's own).
Nothing is filtered for a component that is installed, and every other warning still shows.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Absence:
    """An optional component whose absence is expected on CPU, and the warnings it causes."""

    module: str
    """Import name checked with importlib.util.find_spec (nothing is imported)."""
    notice: str
    """The one line printed instead of the library's warnings."""
    messages: tuple[str, ...]
    """Regular expressions for the start of the UserWarnings Megatron emits about the absence."""


ABSENCES = (
    Absence("transformer_engine", "Transformer Engine not installed: FP8/FP4 emulated, Megatron's local layers",
            (r"Transformer Engine and Apex are not installed",
             r"Only transformer-engine>=\S+ supports MoE experts, but your version is 0\.0\.0")),
    Absence("apex", "apex not installed: Megatron uses its torch kernels (optimizer, norms)",
            (r"Transformer Engine and Apex are not installed", r"Apex is not installed")),
    Absence("absl", "absl-py not installed: Megatron logs through Python logging",
            (r"absl\.logging is not installed",)),
)
# torch.utils.cpp_extension logs this (a WARNING record) at import when CUDA_HOME exists but torch
# sees no CUDA runtime; Megatron imports that module.
CUDA_LOGGER = "torch.utils.cpp_extension"
CUDA_MESSAGE = "No CUDA runtime is found"
MEGATRON_MODULES = r"megatron"  # megatron.core, megatron.training and the vendored megatron_fsdp
# Megatron-Core's own notices that its defaults raise on every run, whatever the user sets
# (0.19.2: a default TransformerConfig counts as the deprecated "full" CUDA-graph scope; an
# experimental MIMO config class warns when imported; every GPTModel logs that GPTModel is
# deprecated). Nothing to act on for a SNIP user: filtered too, by message and megatron's modules.
# compat: 0.19.2 raises these notices, 0.16.1 none of them (the filters then match nothing).
MEGATRON_NOTICES = (r"full scope is deprecated", r"MimoModelConfig is experimental")
GPT_LOGGER, GPT_MESSAGE = "megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"
# Megatron-Bridge logs each TE symbol it cannot find, with a traceback, when TE is absent
# (utils/import_utils.safe_import_from, at INFO on its own handler): part of the TE absence.
BRIDGE_IMPORT_LOGGER = "megatron.bridge.utils.import_utils"
BRIDGE_TE_NOTICE = r"Import of \w+ from megatron\.core\.extensions\.transformer_engine failed"

_done = False


def quiet_startup(stream=None) -> list[str]:
    """Print one line per absent optional component and filter the warnings it replaces.

    Call before anything imports megatron. Prints on global rank 0 only (RANK, as torchrun sets it);
    filters on every rank. Idempotent. Returns the notices of the absent components."""
    global _done
    if _done:
        return []
    _done = True
    stream = stream or sys.stderr
    say = os.environ.get("RANK", "0") == "0"
    notices = []
    for absence in ABSENCES:
        if _installed(absence.module):
            continue
        for message in absence.messages:
            _ignore_megatron_warning(message)
        if absence.module == "transformer_engine":
            _set_filter(BRIDGE_IMPORT_LOGGER, _DropMatching(BRIDGE_TE_NOTICE))
        notices.append(absence.notice)
        if say:
            print(f"[snip] {absence.notice}", file=stream, flush=True)
    for message in MEGATRON_NOTICES:
        _ignore_megatron_warning(message)
    _set_filter(GPT_LOGGER, _DropMessage(GPT_MESSAGE))
    _set_filter(CUDA_LOGGER, _NoCudaRuntime(stream if say else None))
    return notices


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except Exception:  # a broken install counts as installed: its own errors must show
        return True


def _ignore_megatron_warning(message: str) -> None:
    warnings.filterwarnings("ignore", message=message, category=UserWarning, module=MEGATRON_MODULES)


def _set_filter(logger_name: str, new: logging.Filter) -> None:
    """`new` on the logger, replacing one of its kind an earlier call left (one filter, however
    often the state was reset)."""
    logger = logging.getLogger(logger_name)
    logger.filters[:] = [f for f in logger.filters if type(f) is not type(new)]
    logger.addFilter(new)


class _DropMessage(logging.Filter):
    """Drops the records whose message starts with `start`."""

    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


class _DropMatching(logging.Filter):
    """Drops the records whose message matches `pattern` at its start."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(str(record.msg)) is None


class _NoCudaRuntime(_DropMessage):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." record for one line of ours."""

    def __init__(self, stream):
        super().__init__(CUDA_MESSAGE)
        self.stream = stream
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if super().filter(record):
            return True
        if self.stream is not None and not self.said:
            self.said = True
            home = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            print(f"[snip] no CUDA runtime (CUDA_HOME={home} is set): torch runs on the CPU",
                  file=self.stream, flush=True)
        return False
