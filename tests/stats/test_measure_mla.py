"""Statistics of a multi-latent-attention GPT (down-projections duplicated over TP, as Megatron's
TE spec builds them), with and without q_lora_rank, and with q_lora_rank and a multi-token-prediction
layer (mtpmla: its eh_proj and inner MLA layer's linears), at TP=2 with sequence parallelism, and with
q_lora_rank at PP=2 (mla_pp2), equal one process's (1e-5), on every planned linear the GPT adapter
lists for it. (Megatron's MLA trains
another model at TP=2 without SP: megatron/mla.py. MTP at PP=2: tests/stats/test_measure_parallel.py.)"""

from pathlib import Path

import numpy as np
import pytest

from snip_megatron.models import gpt
from snip_megatron.stats.table import StatsTable
from tests.distributed import run_distributed
from tests.stats.test_measure_parallel import assert_same

pytestmark = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("transformer_engine") is None
    and __import__("megatron.core.package_info", fromlist=["x"]).__version__.startswith("0.16."),
    reason="megatron-core 0.16.1's MLASelfAttention cannot be built without Transformer Engine "
           "(isinstance(linear_proj, TELinear) with TELinear None)")

WORKER = str(Path(__file__).with_name("measure_worker.py"))
DISTRIBUTED = ["mla_tp2_sp", "mlaq_tp2_sp", "mtpmla_tp2_sp", "mla_pp2"]
REFERENCE = {"mla_pp2": "mla_name"}  # the same weights, each drawn from its global name


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    from snip_megatron.megatron import runtime
    from tests.stats.measure_worker import MLA, MLA_NO_Q_LORA, SHAPE, measure_layout

    d = tmp_path_factory.mktemp("mla_stats")
    run_distributed([WORKER, "--layouts", ",".join(DISTRIBUTED), "--out", str(d)], nproc=2, timeout=900)
    keys = {"mla": gpt.keys(2, MLA), "mlaq": gpt.keys(2, MLA_NO_Q_LORA),
            "mtpmla": list(gpt.inventory(SHAPE, mla=MLA, mtp_num_layers=1).keys())}
    out = {p.stem: StatsTable.from_array(keys[p.stem.split("_")[0]], np.load(p)) for p in d.glob("*.npy")}
    runtime.init_process_group()
    for name in ("mla_single", "mlaq_single", "mtpmla_single", "mla_name"):
        out[name] = measure_layout(name)
    return out


@pytest.mark.launches
@pytest.mark.parametrize("layout", DISTRIBUTED)
def test_mla_statistics_equal_single_process(tables, layout):
    reference = tables[REFERENCE.get(layout, layout.split("_")[0] + "_single")]
    assert [str(k) for k in reference.keys] == [str(k) for k in tables[layout].keys]
    names = {k.name for k in reference.keys}
    assert {"linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"} <= names
    assert ("linear_q_down_proj" in names) == (not layout.startswith("mlaq_"))
    assert ("linear_q_proj" in names) == layout.startswith("mlaq_")
    mtp = sorted(n for n in names if n.startswith("mtp."))  # the MTP layer: eh_proj, then an MLA layer
    assert mtp == (sorted(["mtp.eh_proj"] + ["mtp." + n for n in names if not n.startswith("mtp.")])
                   if layout.startswith("mtpmla_") else [])
    assert_same(reference, tables[layout])
    for f in ("x_sq", "w_sq", "y_sq", "gy_sq", "gx_sq", "gw_sq", "fwd_z_sq", "ex.fp4", "egy_w.fp4"):
        assert (tables[layout].column(f) > 0).all(), f
