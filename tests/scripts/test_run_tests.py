"""scripts/run_tests.sh, the README's test command, over stand-in lanes.

Each lane's environment and interpreter are replaced by small shell scripts in a copy of the
scripts folder, so the orchestration (lanes side by side, exit codes, whole outputs) is checked in
a second without running the suite again.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.launches

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "run_tests.sh"

FAKE_MAKE_ENV = """#!/usr/bin/env bash
[ -z "${FAIL_ENV:-}" ] || [ "$FAIL_ENV" != "$1" ] || { echo "no wheel for $1"; exit 1; }
"""
# Records when it ran (start end) per environment, taking half a second.
SLOW_MAKE_ENV = """#!/usr/bin/env bash
start=$(date +%s.%N); sleep 0.5; echo "$start $(date +%s.%N)" >> "$OUT/env.$1"
"""
# Stands in for a lane's python: `--version`, or `-m pytest PATHS...` exiting with EXIT_<lane>.
FAKE_PYTHON = """#!/usr/bin/env bash
lane=$(basename "$(dirname "$(dirname "$0")")"); lane=${lane#.venv-}
[ "$1" = "--version" ] && { echo "Python 3.fake"; exit 0; }
shift 2
echo "pytest of $lane: $*"
echo "$OMP_NUM_THREADS" > "$OUT/$lane.threads"
date +%s.%N > "$OUT/$lane.start"
sleep "${SLEEP:-0}"
date +%s.%N > "$OUT/$lane.end"
var="EXIT_$lane"; exit "${!var:-0}"
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_root(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "run_tests.sh")
    _executable(tmp_path / "scripts" / "make_env.sh", FAKE_MAKE_ENV)
    for lane in ("prod", "compat", "bridge"):
        (tmp_path / f".venv-{lane}" / "bin").mkdir(parents=True)
        _executable(tmp_path / f".venv-{lane}" / "bin" / "python", FAKE_PYTHON)
    return tmp_path


def run(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OUT": str(root), **env}
    return subprocess.run(["bash", str(root / "scripts" / "run_tests.sh"), *args], env=full_env,
                          capture_output=True, text=True, timeout=60)


def test_every_lane_runs_its_own_paths_and_the_run_passes(fake_root):
    proc = run(fake_root, "prod", "compat", "bridge", "--", "-x")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pytest of prod: tests --ignore=tests/bridge -x" in proc.stdout
    assert "pytest of compat: tests --ignore=tests/bridge -m compat -x" in proc.stdout  # its marked tests
    assert "pytest of bridge: tests/bridge -x" in proc.stdout
    summary = proc.stdout.split("=== summary")[1]
    assert [line.split(":")[0] for line in summary.strip().splitlines()] == [
        "=== lane prod", "=== lane compat", "=== lane bridge"]


def test_shards_of_a_lane_split_its_paths_and_create_its_environment_one_at_a_time(fake_root):
    _executable(fake_root / "scripts" / "make_env.sh", SLOW_MAKE_ENV)
    proc = run(fake_root, "prod:runs", "prod:units", SNIP_TEST_JOBS="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pytest of prod: tests/te tests/pretrain\n" in proc.stdout
    assert "pytest of prod: tests --ignore=tests/bridge --ignore=tests/te --ignore=tests/pretrain\n" in proc.stdout
    spans = sorted(tuple(map(float, line.split())) for line in (fake_root / "env.prod").read_text().splitlines())
    assert len(spans) == 2 and spans[0][1] <= spans[1][0]  # the second began after the first ended
    summary = proc.stdout.split("=== summary")[1]
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in summary.strip().splitlines()] == [
        "=== lane prod:runs", "=== lane prod:units"]


def test_compat_shards_run_the_compat_tests_and_join_a_marker_of_the_callers(fake_root):
    proc = run(fake_root, "compat:runs", "compat:units", "prod", "--", "-m", "not launches", "-x")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pytest of compat: tests/te tests/pretrain -m compat and (not launches) -x" in proc.stdout
    assert ("pytest of compat: tests --ignore=tests/bridge --ignore=tests/te --ignore=tests/pretrain "
            "-m compat and (not launches) -x") in proc.stdout
    assert "pytest of prod: tests --ignore=tests/bridge -m not launches -x" in proc.stdout


@pytest.mark.parametrize("failing, code", [("compat", "1"), ("bridge", "5")])
def test_one_failing_lane_fails_the_run_and_its_output_is_printed(fake_root, failing, code):
    proc = run(fake_root, "prod", "compat", "bridge", **{f"EXIT_{failing}": code})
    assert proc.returncode == 1
    assert f"=== lane {failing}: exit 1" in proc.stdout  # pytest's 5 (no tests collected) fails too
    assert f"pytest of {failing}" in proc.stdout
    assert "=== lane prod: exit 0" in proc.stdout


def test_a_lane_whose_environment_fails_fails_the_run(fake_root):
    proc = run(fake_root, "prod", "bridge", FAIL_ENV="bridge")
    assert proc.returncode == 1
    assert "no wheel for bridge" in proc.stdout
    assert "lane bridge: its environment could not be created" in proc.stdout


def test_lanes_run_side_by_side_and_each_output_stays_whole(fake_root):
    proc = run(fake_root, "prod", "compat", SLEEP="2", SNIP_TEST_JOBS="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts, ends = ([float((fake_root / f"{lane}.{edge}").read_text()) for lane in ("prod", "compat")]
                    for edge in ("start", "end"))
    # Side by side the two runs overlap; one after the other, the second would start after the first
    # ended (an order, not a duration, so a loaded machine cannot fail it).
    assert max(starts) < min(ends)
    body = proc.stdout.split("=== summary")[0]
    for lane in ("prod", "compat"):  # a lane's lines are printed together
        start = body.index(f"=== lane: {lane}")
        assert body.index(f"pytest of {lane}", start) < body.index(f"=== lane {lane}: exit", start)
        assert "=== lane:" not in body[start + 1:body.index(f"=== lane {lane}: exit", start)]


@pytest.mark.parametrize("jobs, lanes", [("2", ("prod", "compat", "bridge")), ("1", ("prod", "compat")),
                                         ("3", ("prod",))])
def test_each_lane_gets_its_share_of_the_cores(fake_root, jobs, lanes):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(["bash", str(fake_root / "scripts" / "run_tests.sh"), *lanes], capture_output=True,
                          text=True, timeout=60, env={**env, "OUT": str(fake_root), "SNIP_TEST_JOBS": jobs})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    side_by_side = min(int(jobs), len(lanes))
    want = max(1, len(os.sched_getaffinity(0)) // side_by_side)
    assert {(fake_root / f"{lane}.threads").read_text().strip() for lane in lanes} == {str(want)}


def test_a_thread_count_the_user_sets_is_kept(fake_root):
    proc = run(fake_root, "prod", "compat", OMP_NUM_THREADS="7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (fake_root / "compat.threads").read_text().strip() == "7"


def test_one_job_runs_the_lanes_one_after_the_other(fake_root):
    proc = run(fake_root, "prod", "compat", SLEEP="1", SNIP_TEST_JOBS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ends = [float((fake_root / f"{lane}.end").read_text()) for lane in ("prod", "compat")]
    assert ends[1] - ends[0] > 0.9


@pytest.mark.parametrize("args, env, message", [
    (["gpu"], {}, "unknown lane 'gpu' (valid: prod, compat, bridge; prod:runs, prod:units"),
    (["bridge:runs"], {}, "unknown lane 'bridge:runs'"),
    ([], {}, "usage: scripts/run_tests.sh LANE"),
    (["prod"], {"SNIP_TEST_JOBS": "two"}, "SNIP_TEST_JOBS must be a positive integer, got 'two'"),
])
def test_bad_arguments_are_refused_before_any_lane_starts(fake_root, args, env, message):
    proc = run(fake_root, *args, **env)
    assert proc.returncode == 2 and message in proc.stderr
    assert not list(fake_root.glob("*.end"))


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (CI installs it: apt-get install -y shellcheck)")
    scripts = sorted(str(p) for p in (ROOT / "scripts").glob("*.sh"))
    proc = subprocess.run(["shellcheck", "--shell=bash", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
