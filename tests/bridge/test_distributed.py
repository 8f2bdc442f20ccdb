"""TP=2, PP=2 with virtual pipelining and DP=2 with the distributed optimizer (torchrun, gloo, CPU)
re-plan exactly as one process does, and the distributed optimizer resumes exactly.

Every layout starts from the same weights (one checkpoint of a plain Bridge run, loaded weights
only: Bridge seeds each pipeline stage differently, so initial weights would differ), trains the
same data, measures at step 2 and applies the plan at step 3. The formats are MXFP8 / MXFP4
(blocks of 32 along each GEMM's inner dimension): their blocks never straddle a TP shard, so a
TP=2 rank quantizes exactly what one process does. (Blockwise FP8's 1x128 blocks and NVFP4's
per-tensor scale span a whole row or tensor, so at hidden 64 a TP shard is quantized differently:
a real difference of the formats, not of SNIP.)"""

import pytest

from tests.bridge.runs import losses, worker

SNIP = {"warmup": 2, "interval": 10, "lag": 1, "fp4_budget": 0.5, "fp8_recipe": "mxfp8", "fp4_recipe": "mxfp4"}
LAYOUTS = {"tp2": ["--tp", "2"], "pp2_vpp2": ["--pp", "2", "--vpp", "2"], "dp2_distopt": ["--distopt"]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The shared starting weights: a plain Bridge run of one step, checkpointed."""
    root = tmp_path_factory.mktemp("bridge_base")
    worker(root / "out", "--iters", "1", "--save", str(root / "ckpt"), "--save-interval", "1", "--no-snip")
    return root / "ckpt"


@pytest.fixture(scope="module")
def single(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge_single")
    return worker(out, "--iters", "3", "--load", str(base), "--weights-only", snip=SNIP)["ranks"][0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_gives_the_single_process_plan(base, single, tmp_path, layout):
    result = worker(tmp_path / layout, "--iters", "3", "--load", str(base), "--weights-only", *LAYOUTS[layout],
                    snip=SNIP, nproc=2)
    # Bridge continues from the base checkpoint's iteration 1: the initial plan is recorded there
    assert [(h["step"], h["event"]) for h in single["history"]] == [(1, "initial"), (3, "update")]
    assert single["plan"] != single["history"][0]["plan"]  # a real re-plan
    ranks = result["ranks"]
    assert sorted(ranks) == [0, 1]
    covered = {}
    for rank in ranks.values():
        assert rank["history"] == single["history"]  # the same plans at the same steps
        assert rank["plan"] == single["plan"]
        assert rank["local_plan"] and all(single["plan"][k] == p for k, p in rank["local_plan"].items())
        covered.update(rank["local_plan"])
    assert set(covered) == set(single["plan"])  # every linear of every chunk runs the plan
    if layout == "pp2_vpp2":  # rank 0: chunks with layers 1 and 3; rank 1: 2 and 4
        assert sorted({k.split(".")[0] for k in ranks[0]["local_plan"]}) == ["1", "3"]
    assert sorted(losses(result)) == [2, 3]


def test_full_activation_recompute_gives_the_single_process_plan(base, single, tmp_path):
    """The 70B setting's recompute: SNIP measures under it (its statistics come from each layer's
    recompute), and plans and losses are those of the run without it."""
    result = worker(tmp_path / "recompute", "--iters", "3", "--load", str(base), "--weights-only", "--recompute",
                    snip=SNIP)["ranks"][0]
    assert result["history"] == single["history"] and result["plan"] == single["plan"]
    for step, loss in single["losses"].items():
        assert result["losses"][step] == pytest.approx(loss, abs=1e-6), step


def test_distributed_optimizer_resumes_exactly(base, tmp_path):
    """DP=2 with the distributed optimizer: a resume from step 2 trains steps 3-4 as the run that
    went on (megatron-core without apex/TE needs the two loader fixes of tests/bridge/cpu.py)."""
    common = ["--iters", "4", "--distopt", "--save-interval", "2"]
    whole = worker(tmp_path / "whole", *common, "--load", str(base), "--weights-only",
                   "--save", str(tmp_path / "ckpt"), snip=SNIP, nproc=2)
    resumed = worker(tmp_path / "resumed", *common, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "2",
                     "--save", str(tmp_path / "again"), snip=SNIP, nproc=2)
    expected, got = losses(whole), losses(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step
    assert resumed["ranks"][0]["history"] == whole["ranks"][0]["history"]
    assert resumed["ranks"][0]["plan_source"] == "checkpoint"
