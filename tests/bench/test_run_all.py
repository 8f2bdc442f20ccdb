"""bench/gpu/run_all.sh, the first GPU check in one call: its CPU dry run (the checks that fit a short
deadline run, the rest are SKIPPED, one line each, at most 8 files), its refusals, and the wheel
installer it starts with (a wheel from the folder, with its files' modes)."""

import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.launches

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "run_all.sh"
INSTALL = ROOT / "bench" / "gpu" / "install_wheels.sh"
STEPS = ["cast_bits", "emulation", "te_check", "pretrain_local", "compiled_cast", "quality"]


def _env() -> dict:
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _dry_run(out: Path, *args: str) -> list[str]:
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "--device", "cpu", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines == proc.stdout.strip().splitlines()[-len(lines):]  # what it printed, kept
    assert lines[0].startswith("[0/6] machine: CPU (dry run); torch ") and "megatron-core " in lines[0]
    assert lines[-1].startswith("done in ") and ": 0 failed or timed out" in lines[-1]
    assert len(list(out.iterdir())) <= 8
    return lines[1:-1]


def test_the_cpu_dry_run(tmp_path):
    # The first check runs (the others take 15-60 s each on CPU, the whole run ~3 minutes; their
    # CPU logic is tested with each script: test_apply.py runs emulation_cuda_check's)...
    steps = _dry_run(tmp_path / "run", "--only", "1,3")
    assert [line.split(":")[0] for line in steps] == ["[1/6] cast_bits", "[3/6] te_check"]
    assert steps[0].startswith("[1/6] cast_bits: ok in ") and steps[0].endswith("checks=1299 diffs=0 ok=1")
    assert steps[1].startswith("[3/6] te_check: SKIPPED (needs a GPU")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["1-cast_bits.log", "summary.txt"]
    # ... and the whole script under a deadline too short for any check: each one SKIPPED, in order
    steps = _dry_run(tmp_path / "skip", "--deadline", "3")
    assert [line.split(":")[0] for line in steps] == [f"[{i}/6] {name}" for i, name in enumerate(STEPS, 1)]
    assert all(": SKIPPED (" in line for line in steps), steps
    assert "of the 3 s deadline left, it needs 10 s)" in steps[0]


@pytest.mark.parametrize("args,words", [(["--device", "gpu"], "--device cuda or cpu"),
                                        (["--deadline", "5m"], "whole seconds"), (["--bogus"], "unknown option")])
def test_bad_usage_exits_2(tmp_path, args, words):
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path), *args], env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and words in proc.stderr


def test_a_missing_gpu_is_said_and_exits_2(tmp_path):
    if sys.modules.get("torch") is not None and sys.modules["torch"].cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "sees no GPU" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]


def _wheel(folder: Path) -> Path:
    """snipfake-1.0: a module and an executable file (as PuLP's CBC)."""
    path = folder / "snipfake-1.0-py3-none-any.whl"
    files = {"snipfake/__init__.py": "VALUE = 47\n", "snipfake/bin/tool": "#!/bin/sh\necho tool\n",
             "snipfake-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: snipfake\nVersion: 1.0\n",
             "snipfake-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n"}
    files["snipfake-1.0.dist-info/RECORD"] = "".join(f"{name},,\n" for name in [*files, "snipfake-1.0.dist-info/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if name.endswith("tool") else 0o644) << 16
            z.writestr(info, text)
    return path


@pytest.mark.parametrize("pip", [True, False])
def test_wheels_are_installed_where_missing(tmp_path, pip):
    wheels, target = tmp_path / "whl", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels)
    python = sys.executable
    if not pip:  # a Python whose pip is missing: the wheel is unzipped
        python = tmp_path / "python"
        python.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 1\nexec {sys.executable} "$@"\n')
        python.chmod(0o755)
    run = [str(INSTALL), str(python), str(wheels), str(target)]
    proc = subprocess.run([*run, "snipfake:snipfake", "json:json"], env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["snipfake: installed from snipfake-1.0-py3-none-any.whl", "json: importable"]
    assert (target / "snipfake" / "bin" / "tool").stat().st_mode & stat.S_IXUSR
    check = subprocess.run([sys.executable, "-c", "import snipfake; print(snipfake.VALUE)"],
                           env={**_env(), "PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == "47"
    proc = subprocess.run([*run, "nosuchmod:nosuchmod"], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no nosuchmod-*.whl" in proc.stdout


def test_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (CI installs it)")
    proc = subprocess.run(["shellcheck", str(SCRIPT), str(INSTALL)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
