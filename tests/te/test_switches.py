"""Transformer Engine's environment switches that change what a recipe computes, per TE version:
SNIP's table (snip_megatron/te/environment.py, read in TE's sources at v2.14, v2.16, v2.18 and
main) against the TE double laid out per version (tests/te_double/.../common/recipe), and SNIP's
start-up refusals of the switches it does not follow (support/rules/te.py), per installed version.

The double's side runs in subprocesses (the double is importable only there, with a version folder
from te_versions.py before it): TE's own behaviour is tested only against the double."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from snip_megatron.te import environment as env
from tests.te.te_versions import double_pythonpath, te_version_folder

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ("2.14.0", "2.16.0", "2.18.0", "2.20.0.dev0")
"""The TE releases the table cites, and main (d0067d0 reports 2.20.0.dev0)."""

NON_DEFAULT = {env.FP8_CURRENT_POW2_SCALES: "1", env.FP8_BLOCK_FP32_SCALES: "1", env.NVFP4_DISABLE_RHT: "1",
               env.NVFP4_DISABLE_SR: "1", env.NVFP4_DISABLE_2D: "1", env.BACKWARD_OVERRIDE: "dequantized",
               env.NVFP4_ROW_SCALED: "1", env.NVFP4_4OVER6: "weights", env.NVFP4_4OVER6_E4M3_256: "none",
               env.NVFP4_4OVER6_ERR_MODE: "mse"}
"""Every import-time switch set away from TE's default (valid values: TE's recipes take them)."""
FIELDS = {env.FP8_CURRENT_POW2_SCALES: ("Float8CurrentScaling", "use_power_2_scales", False),
          env.FP8_BLOCK_FP32_SCALES: ("Float8BlockScaling", "use_f32_scales", False),
          env.NVFP4_DISABLE_RHT: ("NVFP4BlockScaling", "disable_rht", False),
          env.NVFP4_DISABLE_SR: ("NVFP4BlockScaling", "disable_stochastic_rounding", False),
          env.NVFP4_DISABLE_2D: ("NVFP4BlockScaling", "disable_2d_quantization", False),
          env.BACKWARD_OVERRIDE: ("Float8BlockScaling", "backward_override", None),
          env.NVFP4_ROW_SCALED: ("NVFP4BlockScaling", "row_scaled_activation", False),
          env.NVFP4_4OVER6: ("NVFP4BlockScaling", "nvfp4_4over6", "none"),
          env.NVFP4_4OVER6_E4M3_256: ("NVFP4BlockScaling", "nvfp4_4over6_e4m3_use_256", "all"),
          env.NVFP4_4OVER6_ERR_MODE: ("NVFP4BlockScaling", "nvfp4_4over6_err_mode", "MAE")}
"""Each Python switch's recipe field in TE (class, field, TE's default)."""

PROBE = r"""
import dataclasses, json, sys
import torch
from transformer_engine import __version__
from transformer_engine.common import recipe
import transformer_engine.pytorch as te

fields = json.loads(sys.argv[1])
out = {"version": __version__, "fields": {}}
for name, (cls, field, default) in fields.items():
    value = getattr(getattr(recipe, cls)(), field, "absent")
    out["fields"][name] = value if value == "absent" else value != default
out["backward_override_classes"] = sorted(
    c.__name__ for c in (recipe.DelayedScaling, recipe.Float8CurrentScaling, recipe.MXFP8BlockScaling,
                         recipe.Float8BlockScaling, recipe.NVFP4BlockScaling, recipe.CustomRecipe)
    if "backward_override" in {f.name for f in dataclasses.fields(c)})
try:
    recipe.NVFP4BlockScaling(nvfp4_4over6="most")
    out["4over6_assert"] = None
except AssertionError as e:
    out["4over6_assert"] = str(e)
except TypeError:
    out["4over6_assert"] = "no field"
layer = te.Linear(64, 64, bias=False, params_dtype=torch.float32)
x = torch.randn(32, 64, requires_grad=True)
try:
    with te.autocast(recipe=recipe.Float8BlockScaling(backward_override="high_precision")):
        layer(x)
    out["linear"] = "ran"
except NotImplementedError as e:
    out["linear"] = str(e)
except TypeError:
    out["linear"] = "no field"
print(json.dumps(out))
"""


def _probe(version: str, tmp_path: Path, environ: dict) -> dict:
    folder = te_version_folder(version, tmp_path)
    child = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "TE_DOUBLE_"))}
    child.update(environ, PYTHONPATH=double_pythonpath(te_version=folder), OMP_NUM_THREADS="1",
                 PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(FIELDS)], cwd=tmp_path, env=child,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.launches
@pytest.mark.parametrize("version", VERSIONS)
def test_the_switches_snip_reads_per_version_are_the_ones_the_double_reads(version, tmp_path):
    """With every switch set away from its default, the double of TE `version` moves exactly the
    recipe fields SNIP's table says that version reads, and the double's linears refuse a 2.15+
    variant they do not model (SNIP refuses it before, at start-up)."""
    got = _probe(version, tmp_path, NON_DEFAULT)
    assert got["version"] == version
    for name in NON_DEFAULT:
        moved = got["fields"][name]
        assert moved == (True if env.te_reads(version, name) else "absent"), (name, moved)
    if env.te_reads(version, env.BACKWARD_OVERRIDE):
        assert got["backward_override_classes"] == sorted(["DelayedScaling", "Float8CurrentScaling",
                                                           "MXFP8BlockScaling", "Float8BlockScaling",
                                                           "NVFP4BlockScaling", "CustomRecipe"])
        assert "backward_override='high_precision'" in got["linear"] and "not modelled" in got["linear"]
    else:
        assert got["backward_override_classes"] == [] and got["linear"] == "no field"
    four_over_six = env.te_reads(version, env.NVFP4_4OVER6)
    assert got["4over6_assert"] == ("NVTE_NVFP4_4OVER6 must be one of: 'none', 'weights', 'activations', 'all'."
                                    if four_over_six else "no field")


def test_every_switch_is_cited_per_version_it_is_read_in():
    for switch in env.SWITCHES:
        cited = dict(switch.cited)
        assert set(cited) <= {"2.14", "2.16", "2.18", "main"}, switch.name
        for version in ("2.14", "2.16", "2.18"):
            assert (version in cited) == env.te_reads(version + ".0", switch.name), (switch.name, version)
        assert "main" in cited and switch.snip in ("followed", "refused", "with 4over6"), switch.name
    assert {s.name for s in env.SWITCHES if s.snip == "followed"} == {env.FP8_BLOCK_FP32_SCALES, env.NVFP4_DISABLE_SR}


REFUSALS = [  # (environment, TE version, FP8 used, NVFP4 used, the switches refused)
    ({env.BACKWARD_OVERRIDE: "high_precision"}, "2.14.0", True, True, set()),  # 2.14 does not read it
    ({env.BACKWARD_OVERRIDE: "high_precision"}, "2.15.0", True, False, {env.BACKWARD_OVERRIDE}),
    ({env.BACKWARD_OVERRIDE: ""}, "2.18.0", True, False, {env.BACKWARD_OVERRIDE}),  # set, even empty
    ({env.BACKWARD_OVERRIDE: "dequantized"}, "2.18.0", False, False, set()),  # a BF16-only run
    ({env.NVFP4_ROW_SCALED: "1"}, "2.16.0", True, True, {env.NVFP4_ROW_SCALED}),
    ({env.NVFP4_ROW_SCALED: "1"}, "2.18.0", True, False, set()),  # no FP4 (Hopper): it changes nothing
    ({env.NVFP4_ROW_SCALED: "0"}, "2.18.0", True, True, set()),
    ({env.NVFP4_4OVER6: "none", env.NVFP4_4OVER6_E4M3_256: "weights", env.NVFP4_4OVER6_ERR_MODE: "mse"},
     "2.18.0", True, True, set()),  # the companions act only with 4over6 on
    ({env.NVFP4_4OVER6: "all"}, "2.16.0", True, True, set()),
    ({env.NVFP4_4OVER6: "all"}, "2.17.0", True, True, {env.NVFP4_4OVER6}),
    ({env.NVFP4_4OVER6_ERR_MODE: "l2"}, "2.20.0.dev0", True, True, {env.NVFP4_4OVER6_ERR_MODE}),
    ({env.NVFP4_4OVER6_FAST_MATH: "1"}, "2.18.0", True, True, set()),
    ({env.NVFP4_4OVER6_FAST_MATH: "yes"}, "2.18.0", True, True, {env.NVFP4_4OVER6_FAST_MATH}),
    ({env.FAST_MATH: "1"}, "2.11.0", True, True, set()),
    ({env.FAST_MATH: "1"}, "2.14.0", True, True, {env.FAST_MATH}),
    ({env.FAST_MATH: "0"}, "2.18.0", True, True, set()),
    ({env.FAST_MATH: "1"}, "2.18.0", True, False, set()),
]


@pytest.mark.parametrize("environ, version, fp8, nvfp4, want", REFUSALS)
def test_snip_refuses_the_switches_this_te_reads_for_the_recipes_the_run_uses(environ, version, fp8, nvfp4, want):
    found = env.refused(tuple(environ.items()), version, fp8=fp8, nvfp4=nvfp4)
    assert set(found) == want, found
    for name in want:
        assert found[name]["value"] == environ[name]


def test_a_switch_this_te_does_not_read_yet_is_said_at_start_up():
    environ = ((env.BACKWARD_OVERRIDE, "high_precision"), (env.NVFP4_4OVER6, "all"), ("NVTE_DEBUG", "1"))
    assert env.unread_notices(environ, "2.14.0") == [
        "Transformer Engine 2.14.0 does not read NVTE_BACKWARD_OVERRIDE (read from 2.15): it changes nothing in this "
        "run", "Transformer Engine 2.14.0 does not read NVTE_NVFP4_4OVER6 (read from 2.17): it changes nothing in "
        "this run"]
    assert env.unread_notices(environ, "2.18.0") == [] and env.unread_notices(environ, None) == []


@pytest.mark.parametrize("version", ["2.14.0", "2.18.0"])
def test_a_megatron_lm_run_is_refused_or_told_per_installed_version(version, monkeypatch):
    """snip-pretrain-gpt's start-up check on Blackwell with NVTE_BACKWARD_OVERRIDE set: TE 2.18 runs
    every FP8/FP4 backward on dequantized operands (refused with the fix); TE 2.14 does not read it
    (the run starts, and its start-up lines say the switch changes nothing)."""
    pytest.importorskip("megatron.training.arguments", reason="megatron.training ships with megatron-core >= 0.19")
    from snip_megatron.megatron.te_run import startup_lines
    from snip_megatron.pretrain.setup import check_run
    from snip_megatron.te import gpu, installed
    from tests.support.entry_inputs import megatron_lm_args

    ok = installed.Availability(True)
    monkeypatch.setattr(installed, "te_installed", lambda: True)
    monkeypatch.setattr(installed, "installed_version", lambda: version)
    monkeypatch.setattr(installed, "read_te_support", lambda: installed.TESupport(
        version=version, fp8=ok, fp8_block_scaling=ok, mxfp8=ok, nvfp4=ok))
    monkeypatch.setattr(gpu, "current_sm", lambda: 100)
    for name in [k for k in os.environ if k.startswith("NVTE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(env.BACKWARD_OVERRIDE, "dequantized")
    args = megatron_lm_args("--transformer-impl", "transformer_engine", "--snip")
    if version == "2.18.0":
        with pytest.raises(ValueError, match=r"NVTE_BACKWARD_OVERRIDE='dequantized': Transformer Engine 2.18.0 "
                                             r"\(which reads it from 2.15\) then runs every FP8/FP4 linear's dgrad "
                                             r"and wgrad GEMMs on dequantized operands instead of quantized ones "
                                             r".*; unset NVTE_BACKWARD_OVERRIDE where the run starts"):
            check_run(args)
        return
    lines = startup_lines(check_run(args).te)
    assert ("[snip] Transformer Engine 2.14.0 does not read NVTE_BACKWARD_OVERRIDE (read from 2.15): it changes "
            "nothing in this run") in lines, lines
