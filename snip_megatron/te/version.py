"""Transformer Engine version strings read as (major, minor): the one parser of the facts SNIP keys
by TE version (its availability answers in `te.installed`, the switches it reads in `te.environment`)."""

from __future__ import annotations


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a TE version string; ValueError if it is not one."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(str(version)).release
    except InvalidVersion:
        raise ValueError(f"Transformer Engine reports version {version!r}, which is not a version number") from None
    return (release + (0,))[:2]
