import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.launches

SCRIPT = str(Path(__file__).with_name("resume_script.py"))


def test_resume_matches_uninterrupted_run_with_tp2_and_dp2(data_config, tmp_path):
    """Also with SNIP (the compact loop's DP=2 with the distributed optimizer, MLA at PP=2 and at DP=2):
    the controller's re-plan at step 3 is saved with the checkpoint and the resumed run continues
    on it, step 4's loss the same."""
    # One launch for both layouts: process start-up and Megatron's import dominate the cost.
    run_distributed([SCRIPT, "--data-cache", data_config.cache_dir, "--work", str(tmp_path),
                     "--layouts", "tp2,dp2-distopt,snip-dp2-distopt,snip-mla-pp2,snip-mla-dp2-distopt"],
                    nproc=2, timeout=900)
    results = json.loads((tmp_path / "result.json").read_text())
    assert (results["tp2"]["tp"], results["tp2"]["dp"]) == (2, 1)
    assert (results["dp2-distopt"]["tp"], results["dp2-distopt"]["dp"]) == (1, 2)
    assert (results["snip-mla-pp2"]["pp"], results["snip-mla-dp2-distopt"]["dp"]) == (2, 2)
    for name in ("snip-dp2-distopt", "snip-mla-pp2", "snip-mla-dp2-distopt"):
        assert "'fp4': 0" not in results[name]["plans"][0], results[name]  # the re-plan put linears in FP4
        assert results[name]["resumed_plans"] == results[name]["plans"], results[name]
    for name, r in results.items():
        assert len(r["full"]) == 4 and len(r["resumed"]) == 1, name
        assert r["resumed"][0] == pytest.approx(r["full"][3], rel=1e-6), name
    # Both layouts train the same model on the same 8 samples per step (2 micro-batches on one DP
    # rank, or 1 on each of two): the same losses up to float reordering, which in FP8 can move a
    # value across a rounding boundary (1.1e-4 at step 4 on one machine's stdlib corpus).
    assert results["tp2"]["full"] == pytest.approx(results["dp2-distopt"]["full"], rel=5e-4)
