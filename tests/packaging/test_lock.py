"""Each lane's lock (requirements/LANE.txt) meets the extras its requirements/LANE.in asks for.

`pip check` reads a distribution's plain requirements only, never those of an extra the install
asked for, so a lock can pin what pip would not resolve (prod.in's `pulp[cbc]`: PuLP 4.2.0's extra
asks cbcbox<2.931). Here each extra's requirements, read from the installed distribution's
metadata where this lane has the locked version, must admit the lock's pins.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(lane: str) -> dict[str, str]:
    pins = {}
    for line in (REQUIREMENTS / f"{lane}.txt").read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[canonical(name)] = version.strip()
    return pins


def asked_with_extras(lane: str) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in (REQUIREMENTS / f"{lane}.in").read_text().splitlines())
    return [req for req in map(Requirement, filter(None, lines)) if req.extras]


def extra_requirements(dist: str, extra: str) -> list[Requirement]:
    """The requirements `dist[extra]` adds to `dist`'s own, from its installed metadata."""
    env = default_environment()
    reqs = [Requirement(line) for line in metadata.requires(dist) or []]
    return [r for r in reqs if r.marker is not None and r.marker.evaluate({**env, "extra": extra})
            and not r.marker.evaluate({**env, "extra": ""})]


@pytest.mark.parametrize("lane", ["prod", "compat", "bridge"])
def test_the_lock_meets_every_extra_its_lane_asks_for(lane):
    pins, checked = locked(lane), []
    for asked in asked_with_extras(lane):
        try:
            here = metadata.version(asked.name)
        except metadata.PackageNotFoundError:
            continue
        if here != pins[canonical(asked.name)]:
            continue  # another lane's version is installed here: its metadata is not at hand
        for extra in sorted(asked.extras):
            for req in extra_requirements(asked.name, extra):
                pin = pins.get(canonical(req.name))
                assert pin is not None and req.specifier.contains(pin, prereleases=True), (
                    f"requirements/{lane}.txt pins {req.name}=={pin}, but {asked.name} {here}[{extra}] asks {req}: "
                    f"pip resolves another one (lock again: scripts/make_env.sh --lock {lane})")
                checked.append(f"{asked.name}[{extra}] -> {req.name}=={pin}")
    if not checked:
        pytest.skip(f"no extra of {lane}.in has its locked version installed in this lane")
