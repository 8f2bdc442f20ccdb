"""SnipController in real Megatron-Core runs (gloo): TP=2, PP=2, DP=2 apply the same plan at the
same step as one process; kill-and-resume keeps plan, schedule and losses; no collective on
ordinary steps. TP and DP initialise the same weights as one process; PP initialises differently,
so the PP run continues from a single-process checkpoint (resharded on load). The layout
comparisons train in BF16 before the measurement and measure MXFP8 and NVFP4, whose blocks (32 and
16 elements) lie inside this small model's TP shards: blockwise FP8's 128-element blocks would
straddle them, so its errors, and with them a near-tie of the plan, would differ between layouts
(see emulation tests). Stochastic rounding draws the whole tensor's noise at each shard's columns,
so TP=2 measures what one process measures."""

import json
import sys
from pathlib import Path

import pytest

from tests.distributed import ROOT, run_distributed

pytestmark = pytest.mark.launches

WORKER = str(ROOT / "tests" / "workers" / "controller_worker.py")
MEASURE_STEP, APPLY_STEP = 4, 5  # warmup 4, lag 1
ALIGNED = ("--fp8-recipe", "mxfp8")  # formats whose blocks lie inside TP=2 shards


def _run(out, cache, nproc=1, extra=()):
    run_distributed([WORKER, "--out", str(out), "--data-cache", str(cache), *extra], nproc=nproc,
                    timeout=600)
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A 2-step FP8 run without SNIP, checkpointed: the common starting point."""
    root = tmp_path_factory.mktemp("ctrl")
    cache, ckpt = root / "data", root / "start"
    _run(root / "base", cache, extra=["--no-snip", "--steps", "2", "--save", str(ckpt), "--save-interval", "2"])
    return root, cache, ckpt


@pytest.fixture(scope="module")
def single(start):
    root, cache, ckpt = start
    return _run(root / "single", cache, extra=["--steps", "6", "--initial", "bf16", *ALIGNED])[0]


@pytest.fixture(scope="module")
def single_resumed(start):
    root, cache, ckpt = start
    return _run(root / "single_resumed", cache, extra=["--load", str(ckpt), "--steps", "6"])[0]


def _plans(rank):
    return [(step, json.dumps(plan, sort_keys=True)) for step, plan in rank["applied"]]


def test_single_process_replans_at_the_apply_step(single):
    steps = [s for s, _ in single["applied"]]
    assert APPLY_STEP in steps
    new = dict(single["applied"])[APPLY_STEP]
    assert sum(p == "fp4" for p in new.values()) > 0
    assert single["next_measure"] == MEASURE_STEP + 100


def _same_plans_everywhere(ranks, reference, nproc):
    assert len(ranks) == nproc
    for rank in ranks:
        assert rank["final"] == ranks[0]["final"]
        assert _plans(rank) == _plans(ranks[0])            # same plans at the same steps
    assert _plans(ranks[0]) == _plans(reference)            # and the single-process ones


def test_tp_ranks_apply_the_single_process_plan(start, single, tmp_path):
    root, cache, ckpt = start
    ranks = _run(tmp_path, cache, nproc=2, extra=["--steps", "6", "--tp", "2", "--initial", "bf16", *ALIGNED])
    _same_plans_everywhere(ranks, single, 2)


def test_dp_replicas_apply_one_plan_at_the_same_step(start, single, tmp_path):
    # Each replica measures its own half of the global batch and the statistics are averaged, so
    # the plan equals the single-process one when the replicas see the same data: that equality
    # is checked on the statistics themselves in tests/stats/test_measure_parallel.py. Here: every
    # replica switches to the identical plan at the same step as one process does.
    root, cache, ckpt = start
    ranks = _run(tmp_path, cache, nproc=2, extra=["--steps", "6", "--initial", "bf16", *ALIGNED])
    assert ranks[0]["final"] == ranks[1]["final"] and _plans(ranks[0]) == _plans(ranks[1])
    assert [s for s, _ in ranks[0]["applied"]] == [s for s, _ in single["applied"]]


def test_pipeline_ranks_apply_the_single_process_plan(start, single_resumed, tmp_path):
    root, cache, ckpt = start
    ranks = _run(tmp_path, cache, nproc=2, extra=["--load", str(ckpt), "--steps", "6", "--pp", "2"])
    _same_plans_everywhere(ranks, single_resumed, 2)


def test_no_collective_on_ordinary_steps(start, tmp_path):
    root, cache, ckpt = start
    ranks = _run(tmp_path, cache, nproc=2, extra=["--steps", "6", "--tp", "2"])
    for rank in ranks:
        calls = {int(s): n for s, n in rank["calls"].items()}
        assert calls[MEASURE_STEP] > 0 and calls[APPLY_STEP] > 0
        ordinary = {s: n for s, n in calls.items() if s not in (MEASURE_STEP, APPLY_STEP)}
        assert ordinary and all(n == 0 for n in ordinary.values()), calls


def test_kill_after_plan_change_and_resume(start, tmp_path):
    root, cache, ckpt = start
    full = _run(tmp_path / "full", cache, extra=["--load", str(ckpt), "--steps", "9", "--interval", "3",
                                                 "--save", str(tmp_path / "ck"), "--save-interval", "6"])[0]
    # "killed" after step 6 (plan changed at 5, next measurement at 7): resume from that checkpoint
    resumed = _run(tmp_path / "resumed", cache, extra=["--load", str(tmp_path / "ck"), "--load-step", "6",
                                                       "--steps", "9", "--interval", "3"])[0]
    assert resumed["final"] == full["final"]
    assert resumed["next_measure"] == full["next_measure"]
    assert _plans(resumed)[-1] == _plans(full)[-1]
    for step in ("7", "8", "9"):
        a, b = full["losses"][step], resumed["losses"][step]
        assert abs(a - b) <= 1e-6 * abs(a), (step, a, b)


def test_a_measurement_failing_on_one_rank_is_skipped_on_every_rank(start, tmp_path):
    """A failure that does not repeat does not stop training: rank 1's measurement raises, every rank
    skips that update (one all-reduce of a failure flag) and keeps its plan, and the next measurement
    re-plans as usual."""
    root, cache, ckpt = start
    proc = run_distributed([WORKER, "--out", str(tmp_path), "--data-cache", str(cache), "--steps", "9",
                            "--interval", "3", "--fail-measure-rank", "1"], nproc=2, timeout=600)
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    # the failing rank's cause, a warning; rank 0's decision, once
    assert ("[snip] rank 1: measurement at step 4 failed: the statistics pass: 1.linear_qkv: RuntimeError: "
            "injected statistics failure") in proc.stderr
    assert "rank 0: measurement at step 4 failed" not in proc.stderr
    assert proc.stdout.count("[snip] measurement at step 4 failed (on another rank: see its warning); "
                             "skipping this update") == 1
    for rank in ranks:
        assert [s for s, _ in rank["applied"]] == [0, 8]  # no plan from step 4; step 7's applies at 8
        assert sorted(map(int, rank["losses"])) == list(range(1, 10))
    assert _plans(ranks[0]) == _plans(ranks[1])


def test_the_same_failure_twice_on_one_rank_stops_replanning_on_every_rank(start, tmp_path):
    """Rank 1's measurement fails at steps 4 and 7 the same way: every rank stops re-planning (one
    all-reduce carries the repeat), says so once, and trains on with its plan."""
    root, cache, ckpt = start
    proc = run_distributed([WORKER, "--out", str(tmp_path), "--data-cache", str(cache), "--steps", "11",
                            "--interval", "3", "--fail-measure-rank", "1", "--fail-measure-times", "2"],
                           nproc=2, timeout=600)
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert proc.stderr.count("[snip] rank 1: measurement at step 7 failed: the statistics pass") == 1
    assert proc.stdout.count("stops re-planning") == 1
    assert ("[snip] the measurement failed at two measurements in a row the same way (on another rank: see its "
            "warning), at step 7: SNIP stops re-planning") in proc.stdout
    for rank in ranks:
        assert [s for s, _ in rank["applied"]] == [0]  # nothing measured at 10
        assert sorted(map(int, rank["losses"])) == list(range(1, 12)) and rank["next_measure"] == 13


def test_a_plan_change_failing_on_one_rank_is_undone_on_every_rank(start, tmp_path):
    root, cache, ckpt = start
    out = run_distributed([WORKER, "--out", str(tmp_path), "--data-cache", str(cache), "--steps", "9",
                           "--interval", "3", "--fail-apply-rank", "1"], nproc=2, timeout=600).stdout
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert "rank 1: applying the plan at step 5 failed: RuntimeError: injected apply failure" in out
    assert "applying the plan at step 5 failed on another rank; skipping this update" in out
    for rank in ranks:
        assert [s for s, _ in rank["applied"]] == [0, 8]  # both ranks kept the initial plan at 5
        assert sorted(map(int, rank["losses"])) == list(range(1, 10))
    assert _plans(ranks[0]) == _plans(ranks[1])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
