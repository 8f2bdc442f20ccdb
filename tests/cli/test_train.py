"""snip-train: --dry-run prints the resolved recipe and the exact command; --print-target gives the
launchers one argument a line; errors exit 2 with the field named; a real run execs the command."""

import shlex
import subprocess
import sys

import pytest

from snip_megatron.cli import train as cli
from tests.cli.test_recipes import EXPECTED_70B


def run_cli(capsys, *argv):
    from snip_megatron.errors import run_cli as run

    code = run("snip-train", cli.main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def command_line(out: str) -> list[str]:
    lines = out.splitlines()
    return shlex.split(lines[lines.index("# launch command") + 1])


def test_dry_run_70b_multi_node(capsys):
    code, out, _ = run_cli(capsys, "--dry-run", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "job7",
                           "model=llama_70b", "parallel=tp8_pp8", "train=pretrain", "data=mock",
                           "snip.fp4_budget=0.8")
    assert code == 0
    assert "num_layers: 80" in out and "fp4_budget: 0.8" in out  # the resolved recipe
    assert "# entry: megatron; world size 64 = tp 8 x pp 8 x dp 1" in out
    cmd = command_line(out)
    assert cmd[0] == sys.executable
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nnodes", "8", "--nproc-per-node", "8",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "job7",
                       "-m", "snip_megatron.pretrain", *EXPECTED_70B]


def test_a_multi_node_dry_run_shows_the_rendezvous_as_a_placeholder_a_launch_needs_it(capsys, monkeypatch):
    monkeypatch.delenv("SNIP_RDZV_ENDPOINT", raising=False)
    code, out, err = run_cli(capsys, "--dry-run", "model=llama_70b", "parallel=tp8_pp8")
    assert code == 0, err
    cmd = command_line(out)
    assert cmd[cmd.index("--nnodes") + 1] == "8" and cmd[cmd.index("--rdzv-endpoint") + 1] == cli.RDZV_PLACEHOLDER
    assert f"# {cli.RDZV_PLACEHOLDER}: the c10d rendezvous endpoint" in out
    code, out, err = run_cli(capsys, "--print-command", "model=llama_70b", "parallel=tp8_pp8")  # launch/*.sh
    assert code == 2 and out == "" and "parallel.nnodes=8 needs a rendezvous endpoint" in err


def test_dry_run_tiny_is_the_compact_loop(capsys):
    code, out, _ = run_cli(capsys, "--dry-run", "snip.fp4_budget=0.5", "train.steps=50")
    assert code == 0 and "# entry: compact" in out
    cmd = command_line(out)
    assert cmd[:5] == [sys.executable, "-m", "snip_megatron.train", "--model", "llama_tiny"]
    assert cmd[cmd.index("--steps") + 1] == "50"
    assert cmd[-3:] == ["--snip", "--snip-fp4-budget", "0.5"]


def test_dry_run_single_node_two_processes(capsys):
    code, out, _ = run_cli(capsys, "--dry-run", "parallel=dp2")
    assert code == 0
    cmd = command_line(out)
    assert cmd[1:10] == ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                         "--nproc-per-node", "2", "-m", "snip_megatron.train"]
    assert "--distributed-optimizer" in cmd


def test_print_target_one_argument_a_line(capsys):
    code, out, _ = run_cli(capsys, "--print-target", "model=llama_70b", "parallel=tp8_pp8", "train=pretrain",
                           "data=mock", "snip.fp4_budget=0.8")
    assert code == 0
    assert out.splitlines() == ["-m", "snip_megatron.pretrain", *EXPECTED_70B]


@pytest.mark.parametrize("argv, message", [
    (["parallel=tp8_pp8"], "model.num_attention_heads=4 is not divisible by parallel.tp=8"),
    (["snip.fp4_budget=2"], "snip.fp4_budget must be a fraction in [0, 1]"),
    (["snip.lag=5000"], "snip.lag=5000 must be smaller than snip.interval=1000"),
    (["nosuchgroup=x"], "cannot compose recipe"),
])
def test_errors_exit_2_and_name_the_field(capsys, argv, message):
    code, out, err = run_cli(capsys, "--dry-run", *argv)
    assert code == 2 and out == ""
    assert err.startswith("snip-train: error:") and message in err


def test_without_dry_run_it_execs_the_command(capsys, monkeypatch):
    seen = {}

    def fake_exec(path, argv):
        seen["path"], seen["argv"] = path, argv
        raise SystemExit(0)

    monkeypatch.setattr(cli.os, "execvp", fake_exec)
    with pytest.raises(SystemExit):
        cli.main(["snip=off", "train.steps=50"])
    assert seen["path"] == sys.executable
    assert seen["argv"][:3] == [sys.executable, "-m", "snip_megatron.train"]
    assert "--snip" not in seen["argv"] and seen["argv"][seen["argv"].index("--steps") + 1] == "50"


@pytest.mark.launches
def test_module_entry_point_runs_and_starts_quietly(tmp_path):
    """As snip-pretrain-gpt: one line per expected absence, none of Megatron's warnings about it."""
    from tests.megatron.test_startup import WALL, absent, child_env

    proc = subprocess.run([sys.executable, "-m", "snip_megatron.cli.train", "--dry-run", "model=llama_1b",
                           "parallel=tp1_dp8", "train=pretrain"], cwd=tmp_path, env=child_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "--nproc-per-node 8" in proc.stdout and "--num-query-groups 4" in proc.stdout
    lines = proc.stderr.splitlines()
    assert all(line.startswith("[snip] ") for line in lines) and not any(w in proc.stderr for w in WALL), lines
    for absence in absent():
        assert lines.count(f"[snip] {absence.notice}") == 1, lines
