"""Smoke training through Megatron's schedule, DDP and optimizer: 1 process, TP=2, PP=2, DP=2."""

import json

import pytest

from tests.distributed import run_distributed

pytestmark = pytest.mark.launches

BACKEND = ["--backend", "local"]


def _losses(tmp_path, name, extra, nproc):
    out = tmp_path / f"{name}.json"
    target = ["-m", "snip_megatron.megatron.smoke", "--steps", "8", "--out", str(out), *BACKEND, *extra]
    if nproc == 1:
        run_distributed(target, nproc=1)
    else:
        run_distributed(target, nproc=nproc)
    return json.loads(out.read_text())["losses"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("smoke"), "single", [], 1)


def test_single_process_loss_falls(single):
    assert len(single) == 8
    assert single[-1] < 0.9 * single[0]


def test_tp2_equals_tp1(single, tmp_path):
    tp2 = _losses(tmp_path, "tp2", ["--tp", "2"], 2)
    for a, b in zip(tp2, single):
        assert abs(a - b) <= 1e-5 * abs(b), (tp2, single)


def test_pp2_one_f_one_b_trains(tmp_path):
    pp2 = _losses(tmp_path, "pp2", ["--pp", "2"], 2)
    assert len(pp2) == 8 and pp2[-1] < 0.9 * pp2[0]


def test_dp2_distributed_optimizer_matches_single(single, tmp_path):
    # Same batch on both replicas: averaged gradients equal the single-process ones.
    dp2 = _losses(tmp_path, "dp2", ["--distributed-optimizer"], 2)
    for a, b in zip(dp2, single):
        assert abs(a - b) <= 1e-5 * abs(b), (dp2, single)
