"""MoE statistics over two processes equal one process's (same weights, drawn from each matrix's global
name, and data): expert parallelism (EP=2) with TP=2 and sequence parallelism, expert TP (ETP=2,
Megatron's default ETP = TP), and PP=2, to 1e-5. An expert unit's row adds its local experts, then
ETP, EP and the expert-data-parallel group reduce it (stats/reduce.py); routing stays frozen across
the passes at every layout (the dispatcher's gathers see the clean pass's routing again).

EP=2 at TP=1 spreads each expert's tokens over two data-parallel replicas: an expert's forward
runs both replicas' micro-batches at once, so its statistics per forward (G_W, noise) are another
sample than one process's; its token sums (norms, counts, per-token errors) are compared, in the
dense rows' units (a replica's sums averaged, as a DP=2 run reports them). So are those of expert TP
at TP=1 (ETP=2 on two processes, ETP=2 x EP=2 on four), of Megatron's alltoall dispatcher (made to
run over gloo by the CPU shim), of four processes at TP=2 with SP over two replicas and the experts
on ETP=2 x EP=2, and of TE's grouped experts (over the TE double) at those layouts; layouts that
route the same rows in the same order are compared field by field: the alltoall dispatcher against
the allgather one, TE's grouped experts against SequentialMLP, ETP=2 against EP=2. Context
parallelism (CP=2) on TE's grouped experts equals one process field by field."""

from pathlib import Path

import numpy as np
import pytest

from snip_megatron.models import gpt
from snip_megatron.stats.table import StatsTable
from tests.distributed import run_distributed
from tests.stats.test_measure_parallel import assert_same
from tests.te.te_versions import double_pythonpath

pytestmark = pytest.mark.launches

WORKER = str(Path(__file__).with_name("measure_worker.py"))
DISTRIBUTED = ["moe_tp2_sp_ep2", "moe_tp2_sp_etp2", "moe_pp2", "moe_ep2", "moe_ep2_a2a", "moe_etp2",
               "moemtp_tp2_sp_ep2", "moemtp_pp2", "ds_pp2_vpp2", "ds_tp2_sp_ep2"]
FOUR = ["moe_tp2_sp_etp2_ep2", "moe_etp2_ep2", "moe_etp2_ep2_a2a"]
FOUR_TE = ["temoe_ep2", "temoe_ep2_a2a", "temoe_etp2_ep2", "temoe_tp2_sp_etp2_ep2"]


def _keys(layout: str):
    from tests.stats.measure_worker import LAYOUTS, SHAPE

    overrides = LAYOUTS[layout][3]
    shape = SHAPE.with_(num_layers=overrides.get("layers", SHAPE.num_layers))
    return list(gpt.inventory(shape, moe=gpt.MoEDims.of(type("Config", (), overrides)), mla=overrides.get("mla"),
                              mtp_num_layers=overrides.get("mtp_num_layers", 0)).keys())


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    from snip_megatron.megatron import runtime
    from tests.stats.measure_worker import measure_layout

    d = tmp_path_factory.mktemp("moe_stats")
    run_distributed([WORKER, "--layouts", ",".join(DISTRIBUTED), "--out", str(d)], nproc=2, timeout=900)
    run_distributed([WORKER, "--layouts", ",".join(FOUR), "--out", str(d)], nproc=4, timeout=900)
    run_distributed([WORKER, "--layouts", ",".join(FOUR_TE), "--out", str(d)], nproc=4, timeout=900,
                    env={"PYTHONPATH": double_pythonpath(apex=True), "TE_DOUBLE_COMPUTE_CAPABILITY": "9.0"})
    out = {p.stem: StatsTable.from_array(_keys(p.stem), np.load(p)) for p in d.glob("*.npy")}
    runtime.init_process_group()
    for name in ("moe_single", "moe_single4", "moe_full_recompute", "moe_selective_moe", "moemtp_single", "ds_single"):
        out[name] = measure_layout(name)
    return out


@pytest.mark.parametrize("layout", ["moe_tp2_sp_ep2", "moe_tp2_sp_etp2", "moe_pp2", "moe_full_recompute",
                                    "moe_selective_moe"])
def test_moe_statistics_equal_single_process(tables, layout):
    reference, table = tables["moe_single"], tables[layout]
    assert [str(k) for k in table.keys][2:4] == ["1.expert_fc1", "1.expert_fc2"]
    assert_same(reference, table)
    for f in ("x_sq", "w_sq", "gw_sq", "fwd_z_sq", "bwd_dgw_sq", "ex.fp4", "egy_w.fp4"):
        assert (table.column(f)[:-1] > 0).all(), f
    assert table.globals_["dp_size"] == 1


@pytest.mark.parametrize("layout", ["moemtp_tp2_sp_ep2", "moemtp_pp2"])
def test_an_mtp_layers_experts_are_measured_as_one_process_measures_them(tables, layout):
    """DeepSeek-V3's layout: the MTP layer is an MoE layer (as the last decoder layer is), its
    routed experts planned units `mtp.expert_fc1/2` of depth 1, measured with frozen routing; at
    EP=2 with TP=2 + SP and at PP=2 (the MTP layer on the last stage) the statistics equal one
    process's."""
    reference, table = tables["moemtp_single"], tables[layout]
    mtp = [str(k) for k in table.keys if gpt.is_mtp(k)]
    assert {"1.mtp.expert_fc1", "1.mtp.expert_fc2", "1.mtp.shared_expert_fc1"} <= set(mtp), mtp
    assert_same(reference, table)
    for key in (gpt.LayerKey(1, "mtp.expert_fc1"), gpt.LayerKey(2, "expert_fc2")):
        assert table.get(key, "x_sq") > 0 and table.get(key, "fwd_z_sq") > 0, key


@pytest.mark.parametrize("layout", ["ds_pp2_vpp2", "ds_tp2_sp_ep2"])
def test_a_deepseek_style_model_is_measured_as_one_process_measures_it(tables, layout):
    """MLA + MoE + MTP at PP=2 x VPP=2 (the interleaved schedule: four one-layer chunks) and at
    TP=2 + SP x EP=2: every planned linear's statistics (MLA's, the routed and shared experts', the
    MTP layer's) equal one process's."""
    reference, table = tables["ds_single"], tables[layout]
    names = {k.name for k in table.keys}
    assert {"linear_kv_down_proj", "expert_fc1", "mtp.expert_fc2", "mtp.linear_q_up_proj"} <= names, names
    assert_same(reference, table)


# an expert's token sums: each row of the step once, whichever rank's expert took it
TOKEN_SUMS = ("x_sq", "y_sq", "gy_sq", "gx_sq", "n", "egy_d.fp8", "egy_d.fp4")
WEIGHTS = ("w_sq", "k", "m", "present", "ew.fp8", "ew.fp4", "ew_d.fp8", "ew_d.fp4", "noise_scale")


def replicas(layout: str) -> int:
    from tests.stats.measure_worker import LAYOUTS

    tp, pp = LAYOUTS[layout][:2]
    return (4 if layout in FOUR + FOUR_TE else 2) // (tp * pp)


@pytest.mark.parametrize("layout", ["moe_ep2", "moe_tp2_sp_etp2_ep2", "moe_ep2_a2a", "moe_etp2", "moe_etp2_ep2",
                                    "moe_etp2_ep2_a2a", *FOUR_TE])
def test_experts_over_data_parallel_replicas_reduce_into_the_dense_units(tables, layout):
    one, ep2 = tables["moe_single4"], tables[layout]  # one process measures the step's 4 micro-batches
    assert ep2.globals_["dp_size"] == replicas(layout) > 1 and ep2.nonfinite() == {}
    dense = gpt.LayerKey(1, "shared_expert_fc1")  # the same tokens, on the dense groups
    for f in TOKEN_SUMS + WEIGHTS:
        unit = ep2.get(dense, f) / one.get(dense, f)  # a DP=2 run's units against one process's
        for name in ("expert_fc1", "expert_fc2"):
            key = gpt.LayerKey(1, name)
            assert ep2.get(key, f) == pytest.approx(unit * one.get(key, f), rel=1e-5), (name, f)
    assert ep2.get(dense, "x_sq") == pytest.approx(one.get(dense, "x_sq") / replicas(layout), rel=1e-5)
    for f in ("gw_sq", "fwd_z_sq", "bwd_dgw_sq", "bwd_eta_sq", "ex.fp4", "egy_w.fp4"):
        assert (ep2.column(f)[:-1] > 0).all(), f


@pytest.mark.parametrize("reference, layout", [
    ("moe_ep2", "moe_ep2_a2a"), ("temoe_ep2", "temoe_ep2_a2a"),  # the alltoall dispatcher, the allgather one
    ("moe_etp2_ep2", "temoe_etp2_ep2"), ("moe_tp2_sp_etp2_ep2", "temoe_tp2_sp_etp2_ep2")])  # TE grouped, SequentialMLP
def test_layouts_routing_the_same_rows_in_the_same_order_measure_alike(tables, reference, layout):
    """Every field to 1e-5. Under expert TP a TE grouped fc1's rows are [gate | up] halves on every
    rank, as SequentialMLP's (Megatron marks TE's weights stride 1): its noise and stochastic
    rounding fall on the same features of the whole GEMM (megatron/gemm_view.py)."""
    assert_same(tables[reference], tables[layout])


# Each expert-TP shard of an expert draws its noise from its own replica's micro-batch stream (at
# EP=2 a whole expert draws from its host's): the noise projections are other, equally valid draws.
NOISE_DRAWS = ("fwd_zg_clean", "fwd_zg_noisy", "bwd_dgw_sq")


def test_expert_tp_over_two_replicas_measures_as_expert_parallelism_over_them(tables):
    """ETP=2 at TP=1 against EP=2 over the same two replicas (both route each expert both replicas'
    rows in rank order): expert TP reduces every other field of every row to EP=2's, to 1e-5."""
    assert_same(tables["moe_ep2"], tables["moe_etp2"], skip=NOISE_DRAWS)
    differ = [f for f in NOISE_DRAWS
              if not np.allclose(tables["moe_ep2"].column(f), tables["moe_etp2"].column(f), rtol=1e-5)]
    assert differ, "the noise projections should be other draws (else NOISE_DRAWS says too much)"


def test_a_measurement_leaves_ep2_training_bit_identical(tmp_path):
    """EP=2 over two replicas, expert bias and aux losses on: three steps with a measurement before
    the second (of other micro-batches) leave every rank's parameters and router buffers as three
    steps without one (the routers' token counts of every rank's experts included)."""
    import json

    run_distributed([str(Path(__file__).with_name("moe_untouched_worker.py")), "--out", str(tmp_path)], nproc=2,
                    timeout=600)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert any("expert_bias" in n for n in found["names"]) and any("local_experts.1" in n for n in found["names"])
        assert found["differ"] == [], (rank, found["differ"])


def test_te_grouped_experts_at_cp2_measure_as_one_process(tmp_path):
    """Context parallelism (CP=2 on two processes, Megatron's load-balanced split of every sequence)
    on the TE spec's grouped experts (over the TE double; Megatron's local attention has no CP)
    against one process with the same weights and micro-batches (whole loss masks, Megatron-LM's
    loss): every field of every row to 1e-5, the experts' token counts (every routed row of the
    step once) included. Each CP rank's experts run its own tokens only: an expert's rows are
    gathered over CP in the micro-batch's token order (stats/expert_rows.py), so G_W, the errors
    along tokens and the noise are one process's; its sums over its own rows add over CP."""
    env = {"PYTHONPATH": double_pythonpath(apex=True), "TE_DOUBLE_COMPUTE_CAPABILITY": "9.0"}
    for layout, nproc in (("temoe_whole", 1), ("temoe_cp2", 2)):
        run_distributed([WORKER, "--layouts", layout, "--out", str(tmp_path)], nproc=nproc, timeout=900, env=env)
    one, cp2 = (StatsTable.from_array(_keys(n), np.load(tmp_path / f"{n}.npy")) for n in ("temoe_whole", "temoe_cp2"))
    assert [str(k) for k in cp2.keys][2:4] == ["1.expert_fc1", "1.expert_fc2"]
    for name in ("expert_fc1", "expert_fc2"):
        assert cp2.get(gpt.LayerKey(1, name), "n") == 2 * 2 * 32 * 2  # micro-batches x sequences x tokens x top-k
    assert_same(one, cp2)
    for f in ("x_sq", "gw_sq", "fwd_z_sq", "bwd_dgw_sq", "ex_w.fp8", "egy_w.fp4"):
        assert (cp2.column(f)[:-1] > 0).all(), f
    assert cp2.globals_["dp_size"] == 1
