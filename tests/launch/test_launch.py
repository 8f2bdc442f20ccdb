"""launch/torchrun.sh and launch/slurm.sbatch: their dry runs print the right torchrun command
(1 node x 2 processes; a faked 4-node SLURM allocation), bad layouts stop them, shellcheck is clean."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launches

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_SH = ROOT / "launch" / "torchrun.sh"
SLURM_SBATCH = ROOT / "launch" / "slurm.sbatch"
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_NNODES",
              "SLURM_GPUS_ON_NODE", "SLURM_SUBMIT_DIR", "GPUS_PER_NODE", "DRY_RUN", "SRUN_ARGS")


def run(script: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in SLURM_VARS}
    base.update(PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def test_torchrun_dry_run_one_node_two_processes():
    proc = run(TORCHRUN_SH, "--dry-run", "--nproc", "2", "parallel=dp2", "train.steps=40")
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout)
    assert cmd[:10] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                        "--nproc-per-node", "2", "-m", "snip_megatron.train"]
    assert cmd[cmd.index("--steps") + 1] == "40" and "--distributed-optimizer" in cmd


def test_torchrun_dry_run_megatron_entry_from_env_flag():
    proc = run(TORCHRUN_SH, "model=llama_7b", "parallel=tp4_pp2", "train=pretrain", env={"DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout)
    assert cmd[:8] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                       "--nproc-per-node", "8"]
    assert cmd[8:10] == ["-m", "snip_megatron.pretrain"]
    assert cmd[cmd.index("--tensor-model-parallel-size") + 1] == "4"
    assert cmd[cmd.index("--pipeline-model-parallel-size") + 1] == "2"


def test_torchrun_refuses_a_bad_layout():
    proc = run(TORCHRUN_SH, "--dry-run", "--nproc", "3", "parallel=tp2")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "world size 3" in proc.stderr and "parallel.tp x parallel.pp" in proc.stderr


FAKE_SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_JOB_NUM_NODES": "4",
              "SLURM_GPUS_ON_NODE": "8"}
SLURM_RECIPE = ("model=llama_70b", "parallel=tp8_pp8", "parallel.pp=4", "train=pretrain")


def expected_srun(head: str) -> list[str]:
    return ["srun", "--nodes", "4", "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node", "8",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:29500", "--rdzv-id", "4242",
            "-m", "snip_megatron.pretrain"]


def test_slurm_dry_run_four_nodes_with_scontrol(tmp_path):
    fake = tmp_path / "scontrol"  # `scontrol show hostnames gpu[07-10]` -> one host a line
    fake.write_text("#!/usr/bin/env bash\nprintf 'gpu07\\ngpu08\\ngpu09\\ngpu10\\n'\n")
    fake.chmod(0o755)
    env = {**FAKE_SLURM, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    proc = run(SLURM_SBATCH, "--dry-run", *SLURM_RECIPE, env=env)
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout)
    assert cmd[:21] == expected_srun("gpu07")
    assert cmd[cmd.index("--tensor-model-parallel-size") + 1] == "8"
    assert cmd[cmd.index("--pipeline-model-parallel-size") + 1] == "4"  # 8 x 4 x 1 = 32 = 4 x 8


def test_slurm_dry_run_without_scontrol_parses_the_nodelist():
    if shutil.which("scontrol"):
        pytest.skip("this machine has a real scontrol; the fake one is tested above")
    proc = run(SLURM_SBATCH, *SLURM_RECIPE, env={**FAKE_SLURM, "DRY_RUN": "1", "SRUN_ARGS": "--mpi=none"})
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout)
    assert cmd[:7] == expected_srun("gpu07")[:6] + ["--mpi=none"]
    assert cmd[7:22] == expected_srun("gpu07")[6:]


def test_slurm_checks_the_layout_against_the_allocation():
    proc = run(SLURM_SBATCH, "--dry-run", "model=llama_70b", "parallel=tp8_pp8", "train=pretrain",
               env=FAKE_SLURM)
    assert proc.returncode == 2
    assert "8 x 8 x 1 = 64 != world size 32" in proc.stderr


def test_slurm_outside_an_allocation_says_so():
    proc = run(SLURM_SBATCH, "--dry-run", "model=llama_70b")
    assert proc.returncode != 0 and "not inside a SLURM allocation" in proc.stderr


@pytest.mark.parametrize("script", [TORCHRUN_SH, SLURM_SBATCH], ids=lambda p: p.name)
def test_shellcheck_clean(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (CI installs it: apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_help_prints_usage():
    proc = run(TORCHRUN_SH, "--help")
    assert proc.returncode == 0 and "launch/torchrun.sh [--dry-run]" in proc.stdout
