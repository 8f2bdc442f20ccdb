import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from distributed import run_distributed  # noqa: E402

SCRIPT = str(Path(__file__).with_name("resume_script.py"))


@pytest.mark.parametrize("flags, dp", [(["--tp", "2"], 1), (["--tp", "1", "--distributed-optimizer"], 2)],
                         ids=["tp2", "dp2-distopt"])
def test_resume_matches_uninterrupted_run_on_two_ranks(data_config, tmp_path, flags, dp):
    out = tmp_path / "result.json"
    run_distributed([SCRIPT, *flags, "--data-cache", data_config.cache_dir, "--ckpt", str(tmp_path / "ckpt"),
                     "--out", str(out)], nproc=2, timeout=300)
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["dp"] == dp
    assert len(result["full"]) == 4 and len(result["resumed"]) == 1
    assert result["resumed"][0] == pytest.approx(result["full"][3], rel=1e-6)
