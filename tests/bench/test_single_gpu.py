"""The GPU scripts start Megatron-LM as one rank without a launcher (bench/gpu/single_gpu.py): its
environment opens an env:// process group, which a plain environment cannot; te_check's pretrain
part and hybrid_check's worker are started with it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU))
import single_gpu  # noqa: E402

# Megatron's _initialize_distributed: rank and world size given, the rendezvous from env://
OPEN_GROUP = ("import torch.distributed as d; d.init_process_group('gloo', rank=0, world_size=1); "
              "print(d.get_rank(), d.get_world_size()); d.destroy_process_group()")


def _clean_env() -> dict:
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.mark.launches
def test_the_environment_opens_an_env_process_group():
    plain = subprocess.run([sys.executable, "-c", OPEN_GROUP], env=_clean_env(), capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode != 0 and "MASTER_ADDR" in plain.stderr  # what a launcher-less run hit
    env = single_gpu.single_process_env({**_clean_env(), "RANK": "3", "WORLD_SIZE": "8"})
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == single_gpu.ROOT
    proc = subprocess.run([sys.executable, "-c", OPEN_GROUP], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["0", "1"], proc.stderr[-2000:]


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, GPU / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["te_check", "hybrid_check"])
def test_pretrain_subprocesses_get_it(script, monkeypatch, tmp_path):
    module = _load(f"bench_{script}_launch", f"{script}.py")
    seen = {}
    monkeypatch.setattr(module.subprocess, "run", lambda cmd, **kw: seen.update(cmd=cmd, **kw))
    if script == "te_check":
        module._pretrain(["--train-iters", "1"])
    else:
        module.run_worker(str(tmp_path / "out"), ["--train-iters", "1"])
    env = seen["env"]
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0 and env["WORLD_SIZE"] == "1"
    assert seen["cmd"][0] == sys.executable and "--train-iters" in seen["cmd"]
    sys.modules.pop(f"bench_{script}_launch", None)
