"""The compiled CPU quantizer (csrc/quantize_cpu.cpp): built once, on first use, into torch's
extension cache.

`kernel()` returns the loaded module, or None where it cannot be built (no compiler, no ninja,
SNIP_CPU_KERNEL=0); then `fused.py` runs its eager path, bit for bit the same, and says so once.
The first build on a machine costs a compile (about 30-60 s on 2 cores, logged once); later
processes load the cached library (milliseconds). The library's name carries a hash of the source,
the flags and the torch version; a lock (flock) in its build directory lets one process build while
others wait, so two processes starting at once build it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

_SOURCE = Path(__file__).with_name("csrc") / "quantize_cpu.cpp"
_LOG = logging.getLogger(__name__)
_LOCK = threading.Lock()
_STATE: dict = {}

# Exactness needs IEEE float32 in the source's order: no fast-math, no FMA contraction.
# -fno-trapping-math changes no value (it lets gcc if-convert the branch-free scale loops).
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]


def _arch_flags() -> tuple[list[str], str]:
    """AVX2 code where the CPU has it (wider vectors), else the compiler's baseline. Part of the
    extension's name, so a cache shared between machines never loads code a CPU cannot run."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        flags = []
    if {"avx2", "fma"} <= set(flags):
        return ["-mavx2", "-mfma"], "avx2"
    return [], "base"


def _enabled() -> bool:
    return os.environ.get("SNIP_CPU_KERNEL", "1") not in ("0", "false", "no")


def kernel():
    """The compiled module, building it on first use; None if unavailable (reason logged once)."""
    if "module" in _STATE:
        return _STATE["module"]
    with _LOCK:
        if "module" not in _STATE:
            _STATE["module"] = _build()
    return _STATE["module"]



USE_CPU_KERNEL = True
"""Whether CPU tensors go through the kernel when it builds; False runs the fused path's eager
ops (tests compare both to the reference)."""


@contextlib.contextmanager
def eager_cpu_path():
    """Within: CPU tensors take the eager path, not the kernel (benchmarks time both side by side)."""
    global USE_CPU_KERNEL
    previous, USE_CPU_KERNEL = USE_CPU_KERNEL, False
    try:
        yield
    finally:
        USE_CPU_KERNEL = previous


def use_cpu_kernel() -> bool:
    """Whether a CPU cast runs the kernel now: switched on and built."""
    return USE_CPU_KERNEL and kernel() is not None

def unavailable_reason() -> str | None:
    kernel()
    return _STATE.get("reason")


def _build():
    if not _enabled():
        _STATE["reason"] = "SNIP_CPU_KERNEL=0"
        _LOG.warning("snip: CPU quantization kernel disabled (SNIP_CPU_KERNEL=0): eager fused path")
        return None
    import torch

    arch, tag = _arch_flags()
    # compat: built against the running torch's C++ headers (2.13 in the compat lane, 2.14 in
    # prod). The name carries everything the binary depends on: a cache shared by two torch
    # versions or two CPUs never loads the other's build.
    key = _SOURCE.read_bytes() + " ".join(_FLAGS + arch + [torch.__version__]).encode()
    name = f"snip_quantize_cpu_{tag}_{hashlib.sha1(key).hexdigest()[:10]}"
    start = time.perf_counter()
    try:
        cpp_extension = _import_cpp_extension()
        build_dir = cpp_extension._get_build_directory(name, False)
        # One builder at a time (an flock: released by the kernel if its holder dies); whoever
        # comes next finds the library and loads it without running ninja (about a second).
        with open(os.path.join(build_dir, "snip.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            module = _cached(cpp_extension, name, build_dir)
            if module is None:
                module = cpp_extension.load(name=name, sources=[str(_SOURCE)],
                                            extra_cflags=_FLAGS + arch,
                                            extra_ldflags=["-fopenmp"], verbose=False)
                _LOG.warning("snip: built the CPU quantization kernel %s in %.1f s (once per "
                             "machine and torch version, cached in torch's extension dir)", name,
                             time.perf_counter() - start)
    except Exception as error:  # noqa: BLE001 - any build failure means: use the eager path
        lines = str(error).strip().splitlines() or [""]
        detail = next((line for line in lines if "error" in line.lower()), lines[-1])
        reason = f"{type(error).__name__}: {detail.strip()}"
        _STATE["reason"] = reason
        _LOG.warning("snip: CPU quantization kernel could not be built (%s); using the eager fused "
                     "path (same bits, slower)", reason)
        return None
    return module


def _import_cpp_extension():
    # Importing it logs "No CUDA runtime is found" on every CPU machine: not news here.
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        cpp_logger.setLevel(level)
    return cpp_extension


def _cached(cpp_extension, name: str, build_dir: str):
    """The module from the cache, None if it holds no build (or one that does not load)."""
    if not os.path.exists(os.path.join(build_dir, name + ".so")):
        return None
    try:
        return cpp_extension._import_module_from_library(name, build_dir, True)
    except Exception:  # noqa: BLE001 - a partial file from a killed build: rebuild through load
        return None
