"""TE run-time state SNIP manages (issue 46 item 5), through Megatron's real TE wrappers over the TE
double (tests/te/te_runtime_worker.py, in subprocesses: the double is importable only there):

- the weight-cache re-arm is found by behaviour (a probe module's `is_first_microbatch` must flip
  under `MegatronModule.set_is_first_microbatch`), not from the version number: it passes on
  megatron-core 0.19.2 and fails against a stand-in without Megatron-LM's fix (5389d147), where
  SNIP says so at start-up and turns TE's weight cache off on every TE linear of the model, a
  linear quantized by the user's own precision config included;
- a resume under another TE environment: TE 2.14 keeps the quantizers of the recipe pickled in a
  dense linear's extra state while the recipe class matches; SNIP has them rebuilt from the run's
  recipe and says so; TE 2.18 ignores the pickle itself (and SNIP says nothing).
What TE does here is the double's model of it (file:line in tests/te_double)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.te.te_versions import double_pythonpath, te_version_folder

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "te_runtime_worker.py"
QUANTIZED = {"1.linear_qkv", "1.linear_fc2", "2.linear_fc1", "1.linear_proj", "2.linear_qkv", "2.linear_fc2"}
FP4 = {"1.linear_proj", "2.linear_qkv", "2.linear_fc2"}


def _run(tmp: Path, phase: str, *, version: "str | None" = None, environ: "dict | None" = None) -> dict:
    folder = te_version_folder(version, tmp) if version else None
    child = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "TE_DOUBLE_"))}
    child.update(environ or {}, PYTHONPATH=double_pythonpath(te_version=folder, apex=True), OMP_NUM_THREADS="1",
                 PYTHONWARNINGS="ignore")
    out = tmp / f"{phase}-{version}.json"
    proc = subprocess.run([sys.executable, str(WORKER), phase, "--ckpt", str(tmp / f"ckpt-{version}.pt"),
                           "--out", str(out)], cwd=ROOT, env=child, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and out.exists(), f"{phase} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.launches
def test_the_re_arm_is_probed_and_without_it_every_te_linear_loses_its_cache(tmp_path):
    from snip_megatron.megatron.apply import megatron_core_version

    got = _run(tmp_path, "cache")
    fixed = megatron_core_version() >= (0, 19)  # released megatron-core: 0.19.2 has the fix, 0.16.1 not
    for name, rearms in (("installed", fixed), ("stand_in", False)):
        run = got[name]
        assert run["probe"] is rearms and run["probe_model"] is rearms, (name, run)
        flags = run["cache_off"]
        assert "user_proj" in flags and len(flags) == 9, flags  # 8 planned TE linears and the user's
        assert set(flags.values()) == {not rearms}, (name, flags)
        if rearms:
            assert run["notice"] is None and run["user_runs"] == ["created", "refreshed"], run
        else:  # said at start-up; the user's linear quantizes its live weight at every step
            assert "does not re-arm TE's cached FP8/FP4 weights for a per-module recipe (probed" in run["notice"]
            assert "every TE linear of the model, the --te-precision-config-file ones too" in run["notice"]
            assert run["user_runs"] == ["none", "none"], run


@pytest.mark.launches
@pytest.mark.parametrize("version", ["2.14.0", "2.18.0"])
def test_a_resume_under_another_te_environment_runs_what_snip_measures(version, tmp_path):
    """Saved with NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1 (gradients rounded to nearest), resumed
    without it (SNIP measures stochastic rounding)."""
    saved = _run(tmp_path, "save", version=version, environ={"NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "1"})
    assert set(saved["saved_rounding"]) == FP4 and all(saved["saved_rounding"].values()), saved
    got = _run(tmp_path, "resume", version=version)
    assert got["this_run"] == "stochastic"
    restores = version == "2.14.0"  # TE 2.16.1, 2.17.1 and >= 2.18 ignore a stateless recipe's pickle
    assert set(got["restored"].values()) == {restores}, got
    for key in FP4:
        nearest, spec = got["megatron_alone"][key]
        assert nearest is restores and ((" sr" not in spec) is restores), (key, got["megatron_alone"])
        nearest, spec = got["with_snip"][key]
        assert nearest is False and "grad_output=[nvfp4 e2m1 1x16 rht sr]" in spec, (key, got["with_snip"])
    if restores:
        assert got["said"] == [
            "[snip] the checkpoint's Transformer Engine extra state holds recipes made under another TE environment "
            "(NVFP4BlockScaling disable_stochastic_rounding=True (this run: False)): TE would keep their quantizers "
            "while the recipe class matches, so SNIP has each module build its quantizers from this run's recipe, "
            "the formats SNIP measures"], got["said"]
    else:
        assert got["said"] == [], got["said"]
