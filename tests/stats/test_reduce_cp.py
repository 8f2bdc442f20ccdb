"""Context-parallel ranks are reduced like data-parallel replicas (the measurement's DP reduction
runs over Megatron's data-parallel group with CP). The noise for CP ranks is the whole sequence's,
sliced (tests/stats/test_noise.py). A model with CP does not run on a CPU: Megatron-Core's CP
attention lives in Transformer Engine."""

from pathlib import Path

import numpy as np

from snip_megatron.plan import all_keys
from snip_megatron.stats.reduce import ADAM_FIELDS
from snip_megatron.stats.table import StatsTable
from tests.distributed import run_distributed

WORKER = str(Path(__file__).with_name("cp_worker.py"))


def test_cp_ranks_are_averaged_like_replicas(tmp_path):
    out = tmp_path / "cp.npy"
    run_distributed([WORKER, "--out", str(out)], nproc=2, timeout=300)
    reduced, group_size, cp_size = np.load(out)
    assert (cp_size == 2).all() and (group_size == 2).all()  # DP=1 x CP=2: the group is the CP ranks
    layout = StatsTable(keys=all_keys(1))
    adam = [layout.col(f) for f in ADAM_FIELDS]
    other = [j for j in range(len(layout.fields)) if j not in adam]
    np.testing.assert_allclose(reduced[:, other], 1.5)  # ranks held 1 and 2: the mean
    np.testing.assert_allclose(reduced[:-1, adam], 3.0)  # a distributed optimizer's shards: the sum
