"""The ranks of a context-parallel group are one data-parallel replica: the sums over each rank's
own tokens add over CP, the statistics every CP rank computes alike (on the micro-batch's tokens
gathered over CP, or on the weights) are counted once, the distributed optimizer's shards add up,
and the data-parallel mean runs over DP without CP. The noise for CP ranks is the whole
sequence's, sliced (tests/stats/test_noise.py); a model's whole table at CP=2 equals one
process's (tests/stats/test_measure_te.py)."""

from pathlib import Path

import numpy as np
import pytest

from snip_megatron.plan import all_keys
from snip_megatron.stats.reduce import ADAM_FIELDS
from snip_megatron.stats.table import StatsTable
from tests.distributed import run_distributed

pytestmark = pytest.mark.launches

WORKER = str(Path(__file__).with_name("cp_worker.py"))
OWN_TOKENS = {"x_sq", "n", "y_sq", "gy_sq", "gx_sq", "gx_ex", "fwd_zg_clean", "fwd_zg_noisy", "fwd_z_sq",
              "bwd_eta_sq"}


def test_cp_ranks_add_their_tokens_and_count_the_rest_once(tmp_path):
    out = tmp_path / "cp.npy"
    run_distributed([WORKER, "--out", str(out)], nproc=2, timeout=300)
    sharded, replicated, dp_size, cp_size = np.load(out)
    assert (cp_size == 2).all() and (dp_size == 1).all()  # DP=1 x CP=2
    layout = StatsTable(keys=all_keys(1))
    adam = {layout.col(f) for f in ADAM_FIELDS}
    own = {j for j, f in enumerate(layout.fields) if f.split(".")[0] in OWN_TOKENS}
    assert {layout.fields[j] for j in own} >= {"x_sq", "gx_ex.fp4", "fwd_zg_noisy"}
    for reduced, optimizer_sharded in ((sharded, True), (replicated, False)):
        for j in range(len(layout.fields)):  # the ranks held 1 and 2 everywhere
            summed = j in own or (optimizer_sharded and j in adam)
            np.testing.assert_allclose(reduced[:-1, j], 3.0 if summed else 1.5, err_msg=layout.fields[j])
        np.testing.assert_allclose(reduced[-1], 1.5)  # the run-level row: loss, micro-batches, dp_size
