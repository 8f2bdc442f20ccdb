"""A Transformer Engine run's start-up, the same in the three loops: this GPU, the installed TE's
own answers, the SnipConfig resolved for both, and the lines that say what runs."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from snip_megatron.config import SnipConfig


class TERun(NamedTuple):
    """What the start-up of a TE run settled."""

    config: SnipConfig
    """The user's SnipConfig resolved for this GPU and TE: its `formats` are what the TE linears run,
    its precisions and budget what the planner works with."""
    sm: int
    """The GPU's compute capability."""
    support: Any
    """The installed TE's answers (snip_megatron.te.installed.TESupport)."""


def resolve_for_te(snip: SnipConfig, *, sm: Optional[int] = None) -> TERun:
    """`snip` resolved for Transformer Engine on this GPU (`sm`: its compute capability, default
    read from the GPU) and the installed TE; ValueError listing every setting they cannot run,
    each with its fix (fields named SnipConfig.<field>)."""
    from snip_megatron.te import gpu, installed

    sm = gpu.current_sm() if sm is None else sm
    support = installed.read_te_support()
    return TERun(snip.resolved("te", sm=sm, support=support), sm, support)


def startup_lines(run: TERun) -> list[str]:
    """What each planned precision runs on this GPU and the plan budget; the TE version (and what
    SNIP makes of it), each recipe switch set that this TE does not read yet; what SNIP does about a
    megatron-core that does not refresh TE's weight cache."""
    from snip_megatron.megatron.apply import weight_cache_notice
    from snip_megatron.te.installed import version_notice

    from snip_megatron.te.environment import nvte_environ, unread_notices

    lines = [f"[snip] {run.config.what_runs(run.sm)}"]
    notice = version_notice(run.support.version)
    lines.append(f"[snip] Transformer Engine {run.support.version}" + (f": {notice}" if notice else ""))
    lines += [f"[snip] {line}" for line in unread_notices(nvte_environ(), run.support.version)]
    cache = weight_cache_notice()
    if cache:
        lines.append(f"[snip] {cache}")
    return lines
