"""Running tests/bridge/bridge_worker.py from tests: one process, N processes as torchrun starts them,
or a chain of launches, each forked from a process that imported Bridge once (tests/forked.py), and
its results."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed import ROOT, launch_env, run_distributed, run_python
from tests.forked import MEGATRON_LM, launch as forked_launch

WORKER = str(Path(__file__).with_name("bridge_worker.py"))
BRIDGE = ("tests.bridge.bridge_worker",  # first: installs its lora_layers stand-in before Bridge is imported
          *MEGATRON_LM, "megatron.bridge.training.gpt_step", "megatron.bridge.training.pretrain",
          "megatron.bridge.models.hybrid.hybrid_provider", "megatron.bridge.models.mla_provider",
          "megatron.bridge.recipes.gpt.vanilla_gpt", "snip_megatron.bridge", "snip_megatron.bridge.run",
          "snip_megatron.support.check", "tests.bridge.cpu", "tests.bridge.tiny", "tests.pretrain.pretrain_worker")
"""What the worker imports (bridge_worker.main's imports), imported once before its ranks are forked."""


def worker(out: Path, *args: str, nproc: int = 1, snip: "dict | None" = None, check: bool = True,
           timeout: float = 900, env: "dict | None" = None) -> dict:
    """Run the worker (with `env` added to its environment); returns {rank: its JSON} (empty for a
    run that ended without writing)."""
    argv = [WORKER, "--out", str(out), *args] + (["--snip", json.dumps(snip)] if snip is not None else [])
    if nproc > 1:
        proc = run_distributed(argv, nproc=nproc, timeout=timeout, check=check, env=env, preload=BRIDGE)
    else:
        proc = run_python(argv, cwd=ROOT, env=launch_env(env), timeout=timeout, check=check, preload=BRIDGE)
    return {"ranks": results(out), "returncode": proc.returncode, "stdout": proc.stdout}


def losses(result: dict) -> dict[int, float]:
    """The losses of the last pipeline stage (the rank that reports them), by step."""
    found = [r["losses"] for r in result["ranks"].values() if r["losses"]]
    return {int(k): v for k, v in found[0].items()} if found else {}


def results(out: Path) -> dict:
    """{rank: its JSON} of a worker run that wrote into `out`."""
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))}


def launch(root: Path, launches: list[dict], *, env: dict, timeout: float = 900) -> str:
    """Run `launches` ({"nproc", "argv", "env"}: worker arguments, each rank's extra environment; a
    "target" script instead of the worker) one after another, with `env` added to this process's
    environment; rank r of launch i logs to root/log<i>/rank<r>.log. A failed launch stops the
    chain. Returns the first rank's log of each launch, joined."""
    for i, item in enumerate(launches):
        logs = root / f"log{i}"
        proc = forked_launch([item.get("target", WORKER), *item["argv"]], nproc=item["nproc"],
                             env=launch_env({**env, **item["env"]}), cwd=ROOT, timeout=timeout, preload=BRIDGE, rank_logs=logs)
        assert proc.returncode == 0, f"launch {i} {item['argv']} failed:\n" + "\n".join(
            f"--- rank {r}\n{(logs / f'rank{r}.log').read_text()[-6000:]}" for r in range(item["nproc"]))
    return "\n".join((root / f"log{i}" / "rank0.log").read_text() for i in range(len(launches)))
