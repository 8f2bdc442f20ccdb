"""The installed Transformer Engine's own answers: its version, and what it says it can run here.

SNIP's table of GPU generations (`te.gpu`) says what a generation can run; TE's availability
functions add what only the installed TE knows (its CUDA and cuBLAS checks: blockwise FP8 needs
CUDA >= 12.9, FP8 on Ada cuBLASLt >= 12.1.3), each with TE's reason. Asked once at start-up, so a
recipe TE would refuse at its first forward is refused before training starts.

Supported TE versions: 2.9 (the first with `transformer_engine.pytorch.is_*_available`) and newer.
The run-time behaviour SNIP relies on (per-module autocasts, recipe switches, the weight cache and
fused weight-gradient accumulation) was read in TE 2.14-2.18; a newer TE is said at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from snip_megatron.te.version import version_tuple

MIN_TE_VERSION = (2, 9)
"""The oldest TE SNIP's TE backend runs on: the first with `pytorch.is_*_available(return_reason)`."""
NEWEST_READ_TE_VERSION = (2, 18)
"""The newest TE whose sources SNIP's TE backend was checked against."""
_CHECKS = {"fp8": "is_fp8_available", "fp8_block_scaling": "is_fp8_block_scaling_available",
           "mxfp8": "is_mxfp8_available", "nvfp4": "is_nvfp4_available"}
# Which of TE's checks each recipe needs: TE's autocast asserts FP8 support for every enabled
# recipe, then the recipe's own (TE 2.14 quantization.py, FP8GlobalStateManager.autocast_enter).
_RECIPE_CHECKS = {"tensorwise": ("fp8",), "blockwise": ("fp8", "fp8_block_scaling"),
                  "mxfp8": ("fp8", "mxfp8"), "nvfp4": ("fp8", "nvfp4")}


@dataclass(frozen=True)
class Availability:
    """One of TE's `is_*_available(return_reason=True)` answers."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class TESupport:
    """What the installed TE says about this GPU."""

    version: str
    """`transformer_engine.__version__`, e.g. "2.14.0" or "2.9.0+70f5366"."""
    fp8: Availability
    fp8_block_scaling: Availability
    mxfp8: Availability
    nvfp4: Availability

    def recipe_unavailable(self, recipe: str) -> "str | None":
        """TE's reason it cannot run our recipe `recipe` (blockwise, tensorwise, mxfp8, nvfp4) here,
        or None when it can."""
        for name in _RECIPE_CHECKS[recipe]:
            answer = getattr(self, name)
            if not answer.ok:
                reason = answer.reason.strip().rstrip(".") or f"{_CHECKS[name]}() is False"
                return f"Transformer Engine {self.version} says: {reason}"
        return None

    def runnable(self, recipes) -> list[str]:
        """Those of `recipes` TE runs here."""
        return [r for r in recipes if self.recipe_unavailable(r) is None]


def version_problem(version: str) -> "str | None":
    """Why SNIP's TE backend refuses TE `version` (older than MIN_TE_VERSION), or None."""
    if version_tuple(version) < MIN_TE_VERSION:
        need = ".".join(map(str, MIN_TE_VERSION))
        return (f"Transformer Engine {version} is older than {need}, the oldest SNIP's TE backend runs on; "
                f"install transformer-engine>={need} (the NGC PyTorch image has it)")
    return None


def version_notice(version: str) -> "str | None":
    """A start-up notice for a TE newer than SNIP was checked against, or None."""
    if version_tuple(version) > NEWEST_READ_TE_VERSION:
        newest = ".".join(map(str, NEWEST_READ_TE_VERSION))
        return (f"Transformer Engine {version} is newer than {newest}, the newest SNIP's TE backend was checked "
                "against; the start-up checks ran on it")
    return None


def support_from(te_pytorch, version: str) -> TESupport:
    """TESupport from a `transformer_engine.pytorch` module (TE's functions, or a stand-in)."""
    answers = {}
    for name, function in _CHECKS.items():
        ok, reason = getattr(te_pytorch, function)(return_reason=True)
        answers[name] = Availability(bool(ok), str(reason or ""))
    return TESupport(version=str(version), **answers)


def read_te_support() -> TESupport:
    """The installed TE's version and availability answers on this process's GPU (imports TE).
    ValueError when TE cannot be imported, or is too old to answer."""
    try:
        import transformer_engine
        import transformer_engine.pytorch as te_pytorch
    except Exception as e:  # absent, or a broken install (it raises RuntimeError without CUDA)
        raise ValueError(f"Transformer Engine cannot be imported ({type(e).__name__}: {e}); use "
                         "--transformer-impl local for SNIP's emulated linears") from None
    version = getattr(transformer_engine, "__version__", None)
    if version is None:
        from importlib import metadata

        version = metadata.version("transformer-engine")
    problem = version_problem(version)
    if problem:
        raise ValueError(problem)
    return support_from(te_pytorch, version)


def installed_version() -> "str | None":
    """The installed Transformer Engine's version (`transformer_engine.__version__`, else its
    distribution's), None where it cannot be imported."""
    try:
        import transformer_engine
    except Exception:  # absent, or a broken install
        return None
    version = getattr(transformer_engine, "__version__", None)
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("transformer-engine")
        except metadata.PackageNotFoundError:
            return None
    return str(version)


def te_facts(backend: str) -> dict:
    """The RunFacts fields of the installed TE for a run on `backend`: whether TE imports, its
    version (TE backend only) and the environment's NVTE_* switches."""
    from snip_megatron.te.environment import nvte_environ

    found = te_installed()
    return {"te_installed": found, "te_version": installed_version() if found and backend == "te" else None,
            "te_environ": nvte_environ()}


def te_installed() -> bool:
    """Transformer Engine's PyTorch part imports here (False also for a broken install, which
    raises RuntimeError without CUDA)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True
