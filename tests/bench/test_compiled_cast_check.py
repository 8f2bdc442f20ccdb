"""bench/gpu/compiled_cast_check.py on CPU, where it forces the compiled graph (a smoke test of the
script: its GPU run is what checks Triton's code)."""

import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT

pytestmark = pytest.mark.launches


def test_the_script_checks_and_times_a_key_on_cpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "compiled_cast_check.py"),
                          "--device", "cpu", "--size", "64", "--repeats", "1",
                          "--only", "nvfp4:fprop_input,mxfp4:wgrad_input"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = run.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT device=cpu keys=2 agree=2 "), result
    assert result.endswith(" ok=1"), result
    fields = dict(f.split("=") for f in result.split()[1:])
    assert float(fields["first_call_s_max"]) > 0 and float(fields["compiled_vs_eager"]) > 0
