"""What every snip-analyze run test checks: the printed table, the files, and a checkpoint left as
it was."""

import json
import math
from pathlib import Path

import yaml

from snip_megatron.plan import Plan


def snapshot(folder: Path) -> dict:
    """Every file under `folder`: size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def table_rows(out: str, budgets: list) -> dict:
    """{budget: the row's columns} of the printed table."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("budget"))
    assert lines[head].split()[:8] == ["budget", "Q", "(cost)", "dL/L", "speed-up", "FP4", "FP8+", "Q"], lines[head]
    rows = {float(line.split()[0]): line.split() for line in lines[head + 1: head + 1 + len(budgets)]}
    assert sorted(rows) == sorted(budgets), lines[head:head + 4]
    return rows


def check_analysis(out_dir: Path, printed: str, budgets: list, linears: int, step: int) -> dict:
    """The table and every file agree; SNIP's plans meet their FP4 budgets, cost more as the budget
    grows, and cost no more than the recipe rules on the same measured costs; each static recipe,
    read back by Megatron's own parser, gives every planned linear its plan's precision."""
    from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe

    from snip_megatron.megatron.layout import module_path
    from tests.test_export import precision_of

    rows = table_rows(printed, budgets)
    doc = json.loads((out_dir / "analysis.json").read_text())
    assert doc["step"] == step and doc["budget_kind"] == "fp4_fraction"
    plans = {p["budget"]: p for p in doc["plans"]}
    costs = [plans[b]["predicted_cost"] for b in budgets]
    assert all(a <= b * (1 + 1e-6) for a, b in zip(costs, costs[1:])), costs  # a larger budget costs more
    for b in budgets:
        p, row = plans[b], rows[b]
        assert p["error"] is None and p["fp4_fraction"] >= b - 1e-9
        assert math.isclose(float(row[1]), p["predicted_cost"], rel_tol=1e-3)
        assert int(row[8].rstrip(":")) == len(p["stay_high"])  # after the two rules' Q
        for rule, q in p["rules"].items():  # the ILP's optimum on the same costs is never worse
            assert q >= p["predicted_cost"] * (1 - 1e-3), (b, rule)
        plan = Plan.load(out_dir / p["files"]["json"])
        assert len(plan) == linears and sorted(str(k) for k, v in plan.items() if v.value != "fp4") == \
            sorted(p["stay_high"])
        recipe = load_quantization_recipe(str(out_dir / p["files"]["megatron"]))
        for key, precision in plan.items():
            qc = get_quant_config_or_none(module_path(key.layer - 1, key.name), recipe)
            assert precision_of(qc.config) is precision, key
        bridge = yaml.safe_load((out_dir / p["files"]["bridge"]).read_text())["model"]["quant_recipe"]
        assert len(bridge["matchers"]) == linears
    assert (out_dir / "analysis.png").stat().st_size > 10_000
    return doc
