"""The measurement on Megatron's Transformer Engine spec (over the TE contract double,
tests/te_double: TE itself cannot be installed here) reads what the GEMMs read: the fused
norm+linear's GEMM input is the normalised activation, every statistic equals the local-spec model
with the same weights (1e-5), TE linears run unquantized while measured and keep their plan; with
Megatron's GPU default gradient-accumulation fusion on (tests/apex_double stands in for apex).
At context parallelism CP=2 (the double's CP attention) the table equals one process's."""

import json
from pathlib import Path

import numpy as np
import pytest

from snip_megatron.plan import LayerKey
from snip_megatron.stats.table import StatsTable
from tests.distributed import ROOT, run_distributed
from tests.stats.test_measure_parallel import assert_same
from tests.te.te_versions import double_pythonpath

pytestmark = pytest.mark.launches

WORKER = str(ROOT / "tests" / "stats" / "te_stats_worker.py")


@pytest.mark.parametrize("tp", [1, 2])
def test_te_spec_statistics_equal_the_local_spec(tmp_path, tp):
    run_distributed([WORKER, "--out", str(tmp_path), "--tp", str(tp)], nproc=tp, timeout=600,
                    env={"PYTHONPATH": double_pythonpath(apex=True)})
    for rank in range(tp):
        r = json.loads((Path(tmp_path) / f"rank{rank}.json").read_text())
        bad = {f: w for f, w in r["worst"].items() if not w <= 1e-5}
        assert not bad, bad
        assert abs(r["x_sq"] - r["x_sq_norm"]) <= 1e-5 * r["x_sq_norm"]  # ||RMSNorm(x)||^2 ...
        assert abs(r["x_sq"] - r["x_sq_residual"]) > 1e-2 * r["x_sq_norm"]  # ... not the residual's
        assert r["params_kept"] and r["forward_restored"]
        assert r["runs_during_measurement"] == {k: {} for k in r["runs_during_measurement"]}, \
            r["runs_during_measurement"]  # no TE GEMM (quantized or not) ran while measured


def test_mla_duplicated_te_linears_measure_as_the_local_spec_under_sequence_parallelism(tmp_path):
    """Multi-latent attention at TP=2 with SP: TE's duplicated down-projections (whole weight, this
    rank's tokens) give the statistics of SNIP's duplicated local linear, every row and field to 1e-5
    (and those equal one process's: tests/stats/test_measure_mla.py)."""
    run_distributed([WORKER, "--out", str(tmp_path), "--tp", "2", "--mla", "--sp"], nproc=2, timeout=600,
                    env={"PYTHONPATH": double_pythonpath(apex=True)})
    for rank in range(2):
        r = json.loads((Path(tmp_path) / f"rank{rank}.json").read_text())
        bad = {f: w for f, w in r["worst"].items() if not w <= 1e-5}
        assert not bad, bad
        assert r["keys"][:2] == ["1.linear_q_down_proj", "1.linear_kv_down_proj"]
        assert r["kinds"]["1.linear_kv_down_proj"] is None and r["kinds"]["1.linear_kv_up_proj"] == "column"
        assert r["params_kept"] and r["forward_restored"]


CP_WORKER = str(ROOT / "tests" / "stats" / "te_cp_stats_worker.py")


@pytest.mark.parametrize("model", ["dense", "mla"])
def test_te_spec_statistics_at_cp2_equal_one_process(tmp_path, model):
    """The same weights and micro-batches measured at CP=2 (each rank its tokens by Megatron's
    load-balanced split, its core attention over the whole sequence's keys) and in one process:
    every field of every row to 1e-5 (signed sums to 1e-5 of their Cauchy-Schwarz bound), the loss,
    one replica (dp_size 1); the dense GPT with GQA, and MLA (keys wider than values)."""
    tables, runs = {}, {}
    for cp in (1, 2):
        run_distributed([CP_WORKER, "--out", str(tmp_path), *(["--mla"] if model == "mla" else [])], nproc=cp,
                        timeout=600, env={"PYTHONPATH": double_pythonpath(apex=True)})
        runs[cp] = json.loads((tmp_path / f"cp{cp}.json").read_text())
        keys = [LayerKey(int(k.split(".", 1)[0]), k.split(".", 1)[1]) for k in runs[cp]["keys"]]
        tables[cp] = StatsTable.from_array(keys, np.load(tmp_path / f"cp{cp}.npy"))
    assert {tuple(v) for v in runs[1]["attention"].values()} == {(1, 32, 32)}
    assert {tuple(v) for v in runs[2]["attention"].values()} == {(2, 16, 32)}  # its queries, every key
    assert_same(tables[1], tables[2])
    assert tables[2].globals_["dp_size"] == 1.0
    assert len(tables[2].keys) == (14 if model == "mla" else 8)


MOE_WORKER = str(ROOT / "tests" / "stats" / "te_moe_stats_worker.py")
STOCHASTIC = {"egy_d.fp4", "egy_w.fp4"}
"""NVFP4's output-gradient errors round stochastically from one generator per device, drawn in the
order the backward hooks run: the grouped GEMM's per-expert views and SequentialMLP's experts run
them in different orders, so those two fields agree only statistically."""


def test_te_grouped_experts_measure_as_sequential_mlp_and_pad_their_splits(tmp_path):
    """TE spec, --moe-grouped-gemm (TEGroupedMLP over the double's GroupedLinear) against the local
    spec's SequentialMLP with the same weights: every field of every row equal to 1e-5 (the
    expert units' rows sum each expert GEMM, rows split by m_splits), the stochastic NVFP4 gradient
    errors within 10%; measured unquantized. Then an FP8 expert plan: without SNIP's split padding
    TE refuses the unaligned splits; with it every split is padded to 16 rows; a re-plan to BF16
    pads nothing."""
    run_distributed([MOE_WORKER, "--out", str(tmp_path)], nproc=1, timeout=600,
                    env={"PYTHONPATH": double_pythonpath(apex=True), "TE_DOUBLE_COMPUTE_CAPABILITY": "9.0"})
    r = json.loads((Path(tmp_path) / "rank0.json").read_text())
    bad = {f: w for f, w in r["worst"].items() if not w <= (0.1 if f in STOCHASTIC else 1e-5)}
    assert not bad, bad
    assert r["keys"][2:4] == ["1.expert_fc1", "1.expert_fc2"] and r["expert_n"] == 2 * 2 * 32 * 2  # micro-batches x sequences x tokens x top-k
    assert r["measured_unquantized"]
    assert "not a multiple of 16" in r["unpadded"], r["unpadded"]
    assert r["padded_label"] == "blockwise" and all(n % 16 == 0 for n in r["padded_splits"]), r
    assert r["bf16_label"] == "high_precision" and any(n % 16 for n in r["bf16_splits"]), r


def test_te_grouped_experts_measure_as_sequential_mlp_at_tp2_sp_ep2(tmp_path):
    """The same comparison on two processes, TP=2 with sequence parallelism and EP=2 (expert TP 1):
    each rank's two grouped experts, keyed by their global ids and reduced over the expert groups,
    give the local spec's table at the same layout (which equals one process's:
    tests/stats/test_measure_moe_parallel.py), every field to 1e-5 but the stochastic ones."""
    run_distributed([MOE_WORKER, "--out", str(tmp_path), "--tp2-sp-ep2"], nproc=2, timeout=600,
                    env={"PYTHONPATH": double_pythonpath(apex=True), "TE_DOUBLE_COMPUTE_CAPABILITY": "9.0"})
    for rank in (0, 1):
        r = json.loads((Path(tmp_path) / f"rank{rank}.json").read_text())
        bad = {f: w for f, w in r["worst"].items() if not w <= (0.1 if f in STOCHASTIC else 1e-5)}
        assert not bad, (rank, bad)
        assert r["local_experts"] == 2 and r["dp_size"] == 1 and r["measured_unquantized"]
        assert r["expert_n"] == 2 * 2 * 32 * 2  # every routed row of the step, once
