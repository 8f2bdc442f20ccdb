"""The files SNIP writes into a run folder beside the loop's own, and their readers:
`snip_plans.jsonl` (report.PlanLog: one line per applied plan) and `metrics.jsonl` (the compact
loop's: one line per training step)."""

from __future__ import annotations

import json
from pathlib import Path

from snip_megatron.plan import Plan

PLANS_FILE = "snip_plans.jsonl"
METRICS_FILE = "metrics.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    """Every JSON object of a JSONL file; a truncated last line (a run killed mid-write) is skipped."""
    rows = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return rows


def load_plan_history(run_dir: Path) -> list[tuple[int, Plan]]:
    path = run_dir / PLANS_FILE
    if not path.exists():
        raise ValueError(f"{run_dir} has no {PLANS_FILE}: was SNIP enabled in that run?")
    history = [(int(row["step"]), Plan(row["plan"])) for row in read_jsonl(path)]
    if not history:
        raise ValueError(f"{path} holds no plan")
    return history
