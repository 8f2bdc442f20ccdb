"""Statistics of TP=2, PP=2 and DP=2 runs, with activation recompute (full, selective) and
sequence parallelism, equal the single-process ones (same weights and data); at PP=2 also with a
multi-token-prediction layer on the last stage (mtp_pp2).

DP=2 measures each replica's share of the step's micro-batches (dealt as Megatron deals them);
with every micro-batch measured its table is in the DP layout's units (a replica's sums,
DP-averaged, with `dp_size`), so it is compared with one process through the estimator: the
same costs. dp2_k2 samples one micro-batch per replica, and equals one process measuring those
two: noise and interleaving follow the sample, not the rank."""

from pathlib import Path

import numpy as np
import pytest

from snip_megatron.models import gpt
from snip_megatron.plan import all_keys
from snip_megatron.stats.table import StatsTable
from tests.distributed import run_distributed

pytestmark = pytest.mark.launches

WORKER = str(Path(__file__).with_name("measure_worker.py"))
INNER = {"gx_ex": ("gx_sq", "ex"), "gw_ew": ("gw_sq", "ew"), "fwd_zg_clean": ("gy_sq", "fwd_z_sq"),
         "fwd_zg_noisy": ("gy_sq", "fwd_z_sq")}


def _table(path) -> StatsTable:
    from tests.stats.measure_worker import SHAPE

    mtp = path.stem.startswith("mtp_")  # its MTP layer's linears after the decoder's
    keys = list(gpt.inventory(SHAPE, mtp_num_layers=1).keys()) if mtp else all_keys(2)
    return StatsTable.from_array(keys, np.load(path))


def assert_same(a: StatsTable, b: StatsTable, rtol=1e-5, skip=()):
    """Every field of `b` equals `a`'s, but those whose base name is in `skip`."""
    assert (a.column("present") == 1).all() and (b.column("present") == 1).all()
    for f in a.fields:
        x, y = a.column(f), b.column(f)
        base, _, p = f.partition(".")
        if base in skip:
            continue
        if base in INNER:  # signed sums: relative to their Cauchy-Schwarz bound
            u, v = INNER[base]
            bound = np.sqrt(np.abs(a.column(u + ("." + p if p and u in ("ex", "ew") else "")) *
                                   a.column(v + ("." + p if p and v in ("ex", "ew") else ""))))
            np.testing.assert_array_less(np.abs(x - y), rtol * bound + 1e-12, err_msg=f)
        else:
            np.testing.assert_allclose(y, x, rtol=rtol, atol=1e-12, err_msg=f)
    assert b.globals_["loss"] == pytest.approx(a.globals_["loss"], rel=rtol)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    from snip_megatron.megatron import runtime
    from tests.stats.measure_worker import measure_layout

    d = tmp_path_factory.mktemp("stats")
    run_distributed([WORKER, "--layouts", ",".join(DISTRIBUTED), "--out", str(d)], nproc=2, timeout=1500)
    out = {p.stem: _table(p) for p in d.glob("*.npy")}
    runtime.init_process_group()  # the single-process references (and one-process layouts) run here
    for name in ("single", "single_megatron", "single_lone", "single_megatron_lone", "single4", "pair",
                 "full_recompute", "selective_attn", "selective_mlp", "mtp_single"):
        out[name] = measure_layout(name)
    return out


DISTRIBUTED = ["tp2", "pp2", "dp2", "tp2_lone", "pp2_lone", "tp2_sp", "tp2_sp_lone", "tp2_sp_full", "pp2_full",
               "dp2_k2", "mtp_pp2"]
REFERENCE = {"dp2_k2": "pair",  # the two micro-batches dp2_k2 samples, measured in one process
             "mtp_pp2": "mtp_single"}


@pytest.mark.parametrize("layout", DISTRIBUTED + ["full_recompute", "selective_attn", "selective_mlp"])
def test_parallel_statistics_equal_single_process(tables, layout):
    """_lone: a step of one micro-batch, whose noise pass runs its two halves; _sp: sequence
    parallelism; _full / full_recompute: full activation recompute (every layer checkpointed);
    selective_*: selective recompute of the attention core or the MLP (fc1 and fc2 inside the
    checkpoint); mtp_pp2: an MTP layer (eh_proj and its inner layer's linears) on the last stage."""
    lone = "_lone" if layout.endswith("_lone") else ""
    reference = tables[REFERENCE.get(layout) or ("single_megatron" if layout.startswith("tp2") else "single") + lone]
    table = tables[layout]
    if layout == "dp2":
        from snip_megatron.estimate.cost import cost_table

        want, got = cost_table(tables["single4"]), cost_table(table)
        for key in want.costs:
            for p, q in want.costs[key].items():
                assert got.costs[key][p] == pytest.approx(q, rel=1e-5, abs=1e-12), (key, p)
        assert table.globals_["loss"] == pytest.approx(tables["single4"].globals_["loss"], rel=1e-5)
    else:
        assert_same(reference, table)
    if layout.startswith("mtp_"):
        assert [str(k) for k in table.keys if gpt.is_mtp(k)] == [
            "1.mtp.eh_proj", "1.mtp.linear_qkv", "1.mtp.linear_proj", "1.mtp.linear_fc1", "1.mtp.linear_fc2"]
    assert table.globals_["dp_size"] == (2 if layout.startswith("dp2") else 1)
    # every statistic the estimator needs is there and non-trivial
    for f in ("x_sq", "w_sq", "y_sq", "gy_sq", "gx_sq", "gw_sq", "fwd_z_sq", "ex.fp4", "egy_w.fp4"):
        assert (table.column(f) > 0).all(), f
    # the last linear has no later layer whose noise could reach it
    assert (table.column("bwd_dgw_sq")[:-1] > 0).all() and table.column("bwd_dgw_sq")[-1] == 0
