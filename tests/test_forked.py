"""tests/forked.py, the launcher most multi-process tests go through: each forked rank sees what a
process of its own would (torchrun's variables, the launch's environment and folder, `sys.argv`,
`sys.path[0]`, `__main__`), exits with its own status, and a launch that fails or runs out of time
leaves no rank behind."""

import json
import os
import subprocess
import textwrap
import time

import pytest

from tests.forked import TORCH, launch

pytestmark = pytest.mark.launches

PROBE = textwrap.dedent("""\
    import json, os, sys
    import torch  # imported by the server already

    rank = int(os.environ.get("RANK", "-1"))
    seen = {"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
            "world": os.environ.get("WORLD_SIZE"), "colour": os.environ.get("PROBE_COLOUR"),
            "server": os.getppid(), "torch_loaded_before": "torch" in sys.modules}
    with open(f"rank{rank}.json", "w") as f:
        json.dump(seen, f)
    print(f"rank {rank} done")
    if sys.argv[1:] == ["fail"] and rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    if sys.argv[1:] == ["fail"]:
        import time
        time.sleep(120)  # killed when rank 1 fails
    if sys.argv[1:] == ["refuse"]:
        sys.exit(2)
""")


def env(**extra) -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **extra}


def test_ranks_see_what_a_process_of_their_own_would(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    work = tmp_path / "work"
    work.mkdir()
    first = launch([script, "a", "b"], nproc=2, env=env(PROBE_COLOUR="red"), cwd=work, timeout=120, preload=TORCH)
    assert first.returncode == 0 and sorted(first.stdout.splitlines()) == ["rank 0 done", "rank 1 done"]
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    for seen in ranks:
        assert seen["argv"] == [str(script), "a", "b"] and seen["path0"] == str(tmp_path)
        assert seen["cwd"] == str(work) and seen["name"] == "__main__" and seen["world"] == "2"
        assert seen["colour"] == "red" and seen["torch_loaded_before"]
    # Another launch differing only in a run-time variable: the same server, the new value.
    second = launch([script], nproc=1, torchrun=False, env=env(PROBE_COLOUR="blue"), cwd=work, timeout=120,
                    preload=TORCH)
    alone = json.loads((work / "rank-1.json").read_text())
    assert second.returncode == 0 and alone["colour"] == "blue" and alone["world"] is None
    assert alone["server"] == ranks[0]["server"] == ranks[1]["server"]


def test_a_module_runs_as_python_m_would(tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    done = launch(["-m", "probe_module", "x"], torchrun=False, env=env(), cwd=tmp_path, timeout=120, preload=TORCH)
    seen = json.loads((tmp_path / "rank-1.json").read_text())
    assert done.returncode == 0 and seen["name"] == "__main__" and seen["path0"] == str(tmp_path)
    assert seen["argv"] == [str(tmp_path / "probe_module.py"), "x"]


def test_exit_status_failure_and_timeout(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    refused = launch([script, "refuse"], torchrun=False, env=env(), cwd=tmp_path, timeout=120, preload=TORCH)
    assert refused.returncode == 2
    start = time.monotonic()
    failed = launch([script, "fail"], nproc=2, env=env(), cwd=tmp_path, timeout=120, preload=TORCH)
    assert failed.returncode == 1 and "RuntimeError: rank 1 fails on purpose" in failed.stderr
    assert time.monotonic() - start < 60  # rank 0 (sleeping) was killed, not waited for
    with pytest.raises(subprocess.TimeoutExpired):
        launch([script, "fail"], nproc=1, torchrun=False, env=env(RANK="0"), cwd=tmp_path, timeout=5, preload=TORCH)
    server = json.loads((tmp_path / "rank0.json").read_text())["server"]
    time.sleep(1)
    with pytest.raises(ProcessLookupError):  # the timed-out launch's server is gone, and its rank with it
        os.kill(server, 0)
