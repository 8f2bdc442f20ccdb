"""The wheel, installed outside our lanes, declares honest requirements and brings a CBC the planner runs.

The wheel is built from a copy of the sources (`pip wheel --no-deps --no-build-isolation`: the
lane's setuptools, no network) and installed with --no-deps into a fresh virtual environment,
followed by the PuLP requirement it declares for this Python and numpy (the exact solver's), from
the package index through pip's cache: without the network the install, and so the test, fails.
torch is the one thing the venv borrows: `snip_megatron.formats` imports it at package import
(the planner itself does not use it) and a fresh torch is 0.75-3.5 GB, so the running lane's
site-packages is put on the venv's path *after* its own. The solve must then run the CBC of the
venv's PuLP: a wheel whose PuLP requirement brings no CBC would make PuLP fall through to the
lane's cbcbox, which the path assertions catch. `pip check` passes there, and the CBC is the one
the lane's lock pins (requirements/prod.txt's cbcbox on Python >= 3.12, compat.txt's PuLP on 3.11):
what `pip install snip-megatron` resolves is what the tests ran. Runs in each lane with that lane's Python.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from tests.packaging.test_lock import locked

pytestmark = [pytest.mark.compat, pytest.mark.launches]

ROOT = Path(__file__).resolve().parents[2]
NGC_TORCH = "2.13.0a0+8145d630e8.nv26.06"  # the torch of nvcr.io/nvidia/pytorch:26.06-py3 (docker/README.md)

SOLVE = textwrap.dedent("""
    import json, os
    import numpy, pulp, snip_megatron
    from snip_megatron.formats.precision import Precision as P
    from snip_megatron.plan import all_keys
    from snip_megatron.planner import PlannerConfig, solve_plan
    from snip_megatron.planner.solve import solver_notice

    keys = all_keys(2)
    costs = {k: {P.FP8: 0.0, P.FP4: 1.0 + i} for i, k in enumerate(keys)}
    result = solve_plan(costs, {k: 1.0 for k in keys}, PlannerConfig(rho=0.5))
    print(json.dumps({"solver": result.solver, "status": result.status,
                      "fallback": result.fallback_reason, "notice": solver_notice(),
                      "fp4": result.achieved.fp4_fraction,
                      "files": {m.__name__: m.__file__ for m in (snip_megatron, pulp, numpy)}}))
""")


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines()
            if line.startswith("Requires-Dist:")]


def applies(req: Requirement, extra: str = "") -> bool:
    return req.marker is None or req.marker.evaluate({**default_environment(), "extra": extra})


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "setup.py", src)
    shutil.copytree(ROOT / "snip_megatron", src / "snip_megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(src)])
    wheels = list(dist.glob("snip_megatron-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_declared_requirements(wheel):
    reqs = requirements(wheel)
    pulp = [r for r in reqs if r.name.lower() == "pulp" and applies(r)]
    assert len(pulp) == 1, [str(r) for r in reqs if r.name.lower() == "pulp"]
    if sys.version_info >= (3, 12):  # PuLP >= 4 ships CBC only in its cbc extra
        assert pulp[0].extras == {"cbc"} and not pulp[0].specifier.contains("3.3.2")
    else:  # PuLP 4 needs Python >= 3.12; PuLP 3.x bundles CBC
        assert pulp[0].specifier.contains("3.3.2") and not pulp[0].specifier.contains("4.2.0")
    torch = next(r for r in reqs if r.name == "torch")
    for version in ("2.13.0", "2.14.1", NGC_TORCH):  # the lanes' and the NGC image's (a pre-release)
        assert torch.specifier.contains(version, prereleases=True), (str(torch), version)
    gpu = [r for r in reqs if r.marker is not None and applies(r, "gpu") and not applies(r)]
    assert [(r.name, r.extras) for r in gpu] == [("transformer-engine", {"pytorch"})], [str(r) for r in gpu]
    assert not any(r.name.lower() == "apex" for r in reqs)  # the PyPI apex is not NVIDIA's


def test_fresh_venv_solves_with_its_own_cbc(wheel, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    venv = tmp_path / "venv"
    try:
        run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
        py = venv / "bin" / "python"
        pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q"]
        run(pip + ["--no-deps", str(wheel)], env=env)
        declared = [str(r) for r in requirements(wheel) if r.name.lower() in ("pulp", "numpy")]
        run(pip + declared, env=env)  # pip evaluates the markers: one PuLP line applies

        site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        env=env, cwd=tmp_path).stdout.strip())
        import torch

        (site / "zz_lane_torch.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")
        proc = run([str(py), "-c", SOLVE], env=env, cwd=tmp_path)
        out = json.loads(proc.stdout.strip().splitlines()[-1])

        assert out["solver"] == "cbc" and out["status"] == "optimal", out
        assert out["fallback"] is None and out["fp4"] == pytest.approx(0.5), out
        for name, path in out["files"].items():  # the wheel's package and the venv's PuLP, not the lane's
            assert Path(path).resolve().is_relative_to(site.resolve()), (name, path)
        notice = out["notice"]
        assert notice.startswith("CBC ") and "(version unknown)" not in notice, notice
        cbc = Path(notice.split(" at ", 1)[1].rsplit(" (PuLP ", 1)[0])
        assert cbc.resolve().is_relative_to(site.resolve()), f"CBC not from the venv's PuLP: {notice}"
        assert f"[snip] planner: {notice}" in proc.stderr.splitlines(), proc.stderr
        pins = locked("prod" if sys.version_info >= (3, 12) else "compat")
        assert f"(PuLP {pins['pulp']}" in notice, (notice, pins["pulp"])  # the lock's PuLP, and its CBC
        assert sys.version_info < (3, 12) or notice.endswith(f", cbcbox {pins['cbcbox']})"), (notice, pins["cbcbox"])
        run([sys.executable, "-m", "pip", "--python", str(py), "check"], env=env)
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # cbcbox alone is ~600 MB
