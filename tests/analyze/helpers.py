"""What every snip-analyze run test checks: the printed table, the files, and a checkpoint left as
it was; and how a test runs snip-analyze in a process of its own (tests/analyze/analyze_worker.py,
which records the module paths of the model the analysis built)."""

import json
import math
import os
from pathlib import Path

from snip_megatron.plan import Plan
from tests.distributed import ROOT, run_python
from tests.forked import MEGATRON_LM

WORKER = Path(__file__).with_name("analyze_worker.py")
LOWEST = {"fp4_fraction": "fp4", "fp8_fraction": "fp8"}
"""The precision each budget kind's plans go down to: the linears above it stay high."""


def snapshot(folder: Path) -> dict:
    """Every file under `folder`: size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def analyze(cwd: Path, record: Path, *argv: str, env: "dict | None" = None, timeout: float = 420):
    """snip-analyze `argv` in one process (the worker, `env` added: the TE double's), recording the
    built model's module paths under `record`; the finished process (stdout and stderr apart)."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return run_python([WORKER, record, *argv], cwd=cwd, env=full_env, timeout=timeout, check=False,
                      preload=MEGATRON_LM)


def at_once(*calls) -> list:
    """Each call (a function of no arguments, starting a process) in a thread of its own; their
    results in order (two processes share two cores: the test takes the time of the longer)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def table_rows(out: str, budgets: list, rules: bool = True) -> dict:
    """{budget: the row's columns} of the printed table (`rules`: with the recipe rules' columns)."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("budget"))
    columns = ["budget", "Q", "(cost)", "dL/L", "speed-up", "FP4", "FP8+"] + (["Q"] if rules else ["stay"])
    assert lines[head].split()[:8] == columns, lines[head]
    rows = {float(line.split()[0]): line.split() for line in lines[head + 1: head + 1 + len(budgets)]}
    assert sorted(rows) == sorted(budgets), lines[head:head + 4]
    return rows


def check_analysis(out_dir: Path, printed: str, budgets: list, linears: int, step: int, *,
                   kind: str = "fp4_fraction", modules: "dict | None" = None, pattern: "str | None" = None) -> dict:
    """The table and every file agree; SNIP's plans meet their budgets (FP4, or FP8-or-lower
    fractions), cost more as the budget grows, and cost no more than the recipe rules on the same
    measured costs; each static recipe, read back by Megatron's own parser and instantiated as
    Bridge does, gives every planned module its plan's precision: `modules` ({module path: key}, the
    model the analysis built), else a GPT's at PP=1 (`pattern`: a HybridModel's)."""
    from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe

    from snip_megatron.export import module_glob
    from tests.test_export import bridge_recipe, precision_of

    rules = kind == "fp4_fraction"
    rows = table_rows(printed, budgets, rules)
    doc = json.loads((out_dir / "analysis.json").read_text())
    assert doc["step"] == step and doc["budget_kind"] == kind
    plans = {p["budget"]: p for p in doc["plans"]}
    costs = [plans[b]["predicted_cost"] for b in budgets]
    assert all(a <= b * (1 + 1e-6) for a, b in zip(costs, costs[1:])), costs  # a larger budget costs more
    for b in budgets:
        p, row = plans[b], rows[b]
        assert p["error"] is None and p[kind] >= b - 1e-9
        assert math.isclose(float(row[1]), p["predicted_cost"], rel_tol=1e-3)
        assert int(row[8 if rules else 6].rstrip(":")) == len(p["stay_high"])  # after the rules' Q, if any
        for rule, q in p["rules"].items():  # the ILP's optimum on the same costs is never worse
            assert q is None or q >= p["predicted_cost"] * (1 - 1e-3), (b, rule)
        plan = Plan.load(out_dir / p["files"]["json"])
        assert len(plan) == linears and sorted(str(k) for k, v in plan.items() if v.value != LOWEST[kind]) == \
            sorted(p["stay_high"])
        paths = modules or {module_glob(key, pattern=pattern).replace("*", "local_experts.0."): str(key)
                            for key in plan}
        assert sorted(set(paths.values())) == sorted(map(str, plan))
        for recipe in (load_quantization_recipe(str(out_dir / p["files"]["megatron"])),
                       bridge_recipe(out_dir / p["files"]["bridge"])):
            for path, key in paths.items():
                assert precision_of(get_quant_config_or_none(path, recipe).config) is plan[key], (b, path)
    assert (out_dir / "analysis.png").stat().st_size > 10_000
    return doc
