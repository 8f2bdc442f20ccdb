"""Statistics of a HybridModel over the TE double at TP=2 (`*-*-`) and PP=2 (`*-|*-`) equal one
process's (1e-5), measured through SNIP's discovery of the hybrid model's planned linears (keys =
hybrid layer numbers, the pipeline offset Megatron's `select_pipeline_segment` gives); each stage's
linears are built with their own layer's precision (PlanMatcher at that offset) and every rank
agrees on the inventory of the pattern. Two launches: the one-process references, then TP=2 and
PP=2 in one two-process run (tests/stats/hybrid_stats_worker.py)."""

import json
from pathlib import Path

import numpy as np
import pytest

from snip_megatron.plan import parse_key
from snip_megatron.stats.table import StatsTable
from tests.distributed import run_distributed
from tests.stats.test_measure_parallel import assert_same
from tests.te.te_versions import double_pythonpath

pytestmark = pytest.mark.launches

pytest.importorskip("megatron.core.models.hybrid.hybrid_model",
                    reason="megatron-core 0.16.1 (compat lane) has MambaModel, not HybridModel (0.18+)")

WORKER = str(Path(__file__).with_name("hybrid_stats_worker.py"))


def table(out: Path, name: str) -> StatsTable:
    keys = [parse_key(k) for k in json.loads((out / f"{name}.json").read_text())["keys"]]
    return StatsTable.from_array(keys, np.load(out / f"{name}.npy"))


def test_hybrid_statistics_at_tp2_and_pp2_equal_one_process(tmp_path):
    env = {"PYTHONPATH": double_pythonpath(), "TE_DOUBLE_COMPUTE_CAPABILITY": "9.0"}
    run_distributed([WORKER, "--layouts", "single_megatron,single_name", "--out", str(tmp_path)], nproc=1,
                    timeout=600, env=env)
    run_distributed([WORKER, "--layouts", "tp2,pp2", "--out", str(tmp_path)], nproc=2, timeout=600, env=env)
    for reference, layout in (("single_megatron", "tp2"), ("single_name", "pp2")):
        assert_same(table(tmp_path, reference), table(tmp_path, layout))
    keys = ["1.linear_qkv", "1.linear_proj", "2.linear_fc1", "2.linear_fc2",
            "3.linear_qkv", "3.linear_proj", "4.linear_fc1", "4.linear_fc2"]
    plan = {k: "fp8" if int(k.split(".")[0]) % 2 else "bf16" for k in keys}
    pp2 = json.loads((tmp_path / "pp2.json").read_text())
    assert pp2["keys"] == pp2["agreed"] == keys
    # stage 1 holds hybrid layers 3 and 4 at local indices 0 and 1, built at their own precision
    assert pp2["built"] == [{k: plan[k] for k in keys[:4]}, {k: plan[k] for k in keys[4:]}]
    tp2 = json.loads((tmp_path / "tp2.json").read_text())
    assert tp2["built"] == [plan, plan]
