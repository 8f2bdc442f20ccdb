"""TP=2 gives the numbers of TP=1 for every precision (2-process gloo run of tp_worker.py), and for
NVFP4's stochastically rounded gradients on a gated fc1's strided shards."""

import json

import pytest

from tests.distributed import run_distributed

pytestmark = pytest.mark.launches

# Tensors no rank sums across are bit-identical; the others (Y of the row-parallel layer, G_X of
# the column-parallel one) differ only by the order of an FP32 all-reduce.
EXACT = ("h", "gh", "gw_col", "gw_row")
SUMMED = ("y", "gx")
SUMMED_RTOL = 1e-5


def test_tp2_equals_tp1_every_recipe():
    proc = run_distributed(["tests/emulation/tp_worker.py"], nproc=2, timeout=240)
    rows = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
            if line.startswith("TP_RESULT ")]
    recipes = ["bf16:bf16", "fp8:blockwise", "fp8:tensorwise", "fp8:mxfp8", "fp4:nvfp4", "fp4:mxfp4"]
    assert [(r["recipe"], r["sequence_parallel"]) for r in rows] == \
        [(name, sp) for sp in (False, True) for name in recipes] + [("fp4:nvfp4:stride2", False)]
    for r in rows:
        for name in EXACT:
            assert r[name] == 0.0, (r["recipe"], name, r)
        for name in SUMMED:
            assert r[name] < SUMMED_RTOL, (r["recipe"], name, r)
