"""The one start-up line saying which solver the planner runs (CBC's version and path, or why not)."""

import os

import pytest

from snip_megatron.formats.precision import Precision as P
from snip_megatron.plan import all_keys
from snip_megatron.planner import ilp as ilp_module
from snip_megatron.planner import solve as solve_module
from snip_megatron.planner.config import PlannerConfig
from snip_megatron.planner.ilp import cbc_banner_version
from snip_megatron.planner.solve import solve_plan, solver_notice

# What `cbc -quit` prints, abridged, for the two binaries the lanes get.
PULP3_BANNER = "Welcome to the CBC MILP Solver \nVersion: 2.10.3 \nBuild Date: Dec 15 2019 \n"
CBCBOX_BANNER = "Welcome to the CBC MILP Solver\nVersion: Devel (unstable)\nBuild Date: Mar 23 2026\n"
LATER_CBCBOX_BANNER = "CBC devel (git:146ce89) \u2014 COIN-OR Branch and Cut\n  args: -quit\n"


def test_banner_versions():
    assert cbc_banner_version(PULP3_BANNER) == "2.10.3"
    assert cbc_banner_version(CBCBOX_BANNER) == "Devel"
    assert cbc_banner_version(LATER_CBCBOX_BANNER) == "devel (git:146ce89)"
    assert cbc_banner_version("something else") == "(version unknown)"


@pytest.mark.compat
def test_notice_names_the_cbc_binary_of_this_lane():
    # Both lanes install a CBC (PuLP 3's bundled binary, or cbcbox through pulp[cbc]).
    notice = solver_notice(PlannerConfig())
    assert notice.startswith("CBC ") and "(version unknown)" not in notice, notice
    path = notice.split(" at ", 1)[1].rsplit(" (PuLP ", 1)[0]
    assert os.path.isfile(path) and os.access(path, os.X_OK), path


def test_notice_says_why_the_exact_solver_runs(monkeypatch):
    assert solver_notice(PlannerConfig(solver="exact")) == "exact solver (PlannerConfig.solver='exact')"
    assert "cbc_path='/no/such/cbc' is not a runnable CBC" in solver_notice(PlannerConfig(cbc_path="/no/such/cbc"))
    monkeypatch.setattr(ilp_module, "_cbc_command", lambda config, time_limit_s=None: None)
    assert solver_notice(PlannerConfig()).startswith("exact solver: CBC not found (PuLP >= 4 needs `pip install pulp[cbc]`")


def test_announced_once_per_process(monkeypatch, capsys):
    monkeypatch.setattr(solve_module, "_announced", False)
    keys = all_keys(2)
    costs = {k: {P.FP8: 0.0, P.FP4: 1.0 + i} for i, k in enumerate(keys)}
    flops = {k: 1.0 for k in keys}
    for _ in range(3):
        solve_plan(costs, flops, PlannerConfig(rho=0.5))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[snip] planner:")]
    assert lines == [f"[snip] planner: {solver_notice(PlannerConfig(rho=0.5))}"]
