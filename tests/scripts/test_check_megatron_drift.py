"""scripts/check_megatron_drift.sh: the patches and the seams against a Megatron-LM checkout, in one
command. Run on a small checkout made of the installed megatron-core (its `megatron/` linked in,
pretrain_*.py rebuilt from the patches' own context), as it is and with one patch hunk and one
seam broken; and on the checkout MEGATRON_LM_CHECKOUT names, when it is set."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launches

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_megatron_drift.sh"
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
needs_training = pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is None,
    reason="the seams of Megatron-LM's loop live in megatron.training (megatron-core >= 0.19, prod lane)")


def drift(checkout: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), str(checkout)], env=env, capture_output=True, text=True,
                          timeout=600)


def pre_images(patch: Path) -> dict:
    """{file: text} holding each hunk's old side in order: a file the patch applies to."""
    files, current = {}, None
    for line in patch.read_text().splitlines():
        if line.startswith("--- a/"):
            current = files.setdefault(line[len("--- a/"):], [])
        elif line.startswith(("+++", "@@")) or line.startswith("\\"):
            if line.startswith("@@") and current:
                current.append("# (lines the patch does not show)")
        elif current is not None and line[:1] in (" ", "-"):
            current.append(line[1:])
    return {name: "\n".join(lines) + "\n" for name, lines in files.items()}


def _installed(package: str) -> Path:
    """The installed package's folder, found without importing it."""
    return Path(importlib.util.find_spec(package).origin).parent


def fake_checkout(where: Path, *, broken: bool = False) -> Path:
    """A Megatron-LM checkout made of the installed megatron-core; `broken`: the hybrid script's
    first hunk context changed, and Megatron's train() calling train_step by another name."""
    where.mkdir()
    for patch in PATCHES:
        for name, text in pre_images(patch).items():
            if broken and name == "pretrain_hybrid.py":
                text = text.replace("has_nvidia_modelopt = False", "has_modelopt = False", 1)
            (where / name).write_text(text)
    (where / "megatron").mkdir()
    (where / "megatron" / "core").symlink_to(_installed("megatron.core"))
    training = _installed("megatron.training")
    if not broken:
        (where / "megatron" / "training").symlink_to(training)
        return where
    (where / "megatron" / "training").mkdir()
    for entry in training.iterdir():
        if entry.name not in ("training.py", "__pycache__"):
            (where / "megatron" / "training" / entry.name).symlink_to(entry)
    source = (training / "training.py").read_text()
    assert source.count(") = train_step(") == 1, "the installed train() changed: update this test's edit"
    (where / "megatron" / "training" / "training.py").write_text(
        source.replace(") = train_step(", ") = _step_by_another_name(")
        + "\n\n_step_by_another_name = train_step\n")
    return where


@needs_training
def test_a_checkout_of_the_installed_megatron_passes(tmp_path):
    proc = drift(fake_checkout(tmp_path / "Megatron-LM"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith(("ok", "FAIL"))][:2] == [
        "ok   megatron-lm-pretrain_gpt.patch", "ok   megatron-lm-pretrain_hybrid.patch"]
    assert f"at {tmp_path / 'Megatron-LM'}" in proc.stdout  # the checkout's megatron, not the installed one
    assert "ok   megatron-lm megatron.training.training.train_step" in lines
    assert re.search(r"^all \d+ seams hold$", proc.stdout, re.M)


@needs_training
def test_a_hunk_that_no_longer_applies_and_a_bypassed_seam_fail_naming_them(tmp_path):
    proc = drift(fake_checkout(tmp_path / "Megatron-LM", broken=True))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "ok   megatron-lm-pretrain_gpt.patch" in lines and "FAIL megatron-lm-pretrain_hybrid.patch" in lines
    assert "       error: patch failed: pretrain_hybrid.py:76" in lines
    at = lines.index("FAIL megatron-lm megatron.training.training.train_step")
    assert lines[at + 1] == ("       megatron.training.training.train no longer looks train_step up in "
                             "megatron.training.training, so SNIP's wrapper there would never run")
    assert re.search(r"^1 of \d+ seams fail$", proc.stdout, re.M)


def test_bad_usage_exits_2(tmp_path):
    for args, words in (([], "usage: scripts/check_megatron_drift.sh MEGATRON_LM_CHECKOUT"),
                        ([str(tmp_path)], "not a Megatron-LM checkout (no megatron/core in it)"),
                        ([str(tmp_path / "absent")], "no such folder")):
        proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_CHECKOUT"),
                    reason="MEGATRON_LM_CHECKOUT names no Megatron-LM checkout to check (the installed "
                           "megatron-core is checked above)")
def test_the_checkout_megatron_lm_checkout_names_passes():
    proc = drift(Path(os.environ["MEGATRON_LM_CHECKOUT"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
