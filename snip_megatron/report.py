"""Draw what SNIP did in a run: precision per layer over training (heat map) and the loss curve.

    python -m snip_megatron.report <run dir>

Reads `<run dir>/snip_plans.jsonl` (one line per plan the controller applied: step, plan) and
`<run dir>/metrics.jsonl` (one line per training step: step, loss, optionally val_loss), writes
`<run dir>/snip_heatmap.png` and `<run dir>/loss.png`, and prints their paths.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import Plan

PLANS_FILE = "snip_plans.jsonl"
METRICS_FILE = "metrics.jsonl"
_CODE = {Precision.BF16: 2, Precision.FP8: 1, Precision.FP4: 0}


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


def draw_heatmap(history: list[tuple[int, Plan]], out: Path, last_step: int | None = None) -> Path:
    """Layers (rows, forward order) x training steps (columns), colour = precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    keys = list(history[-1][1])
    steps = [s for s, _ in history]
    end = max(last_step or steps[-1], steps[-1] + 1)
    grid = np.full((len(keys), len(steps)), np.nan)
    for j, (_, plan) in enumerate(history):
        for i, key in enumerate(keys):
            if key in plan:
                grid[i, j] = _CODE[plan[key]]
    edges = steps + [end]
    fig, ax = plt.subplots(figsize=(8, max(3, 0.16 * len(keys) + 1.5)))
    cmap = ListedColormap(["#d62728", "#ff7f0e", "#1f77b4"])  # fp4, fp8, bf16
    ax.pcolormesh(edges, np.arange(len(keys) + 1), grid, cmap=cmap, vmin=-0.5, vmax=2.5)
    ax.set_yticks(np.arange(len(keys)) + 0.5)
    ax.set_yticklabels([str(k) for k in keys], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("training step")
    ax.set_title("SNIP precision per linear layer (red FP4, orange FP8, blue BF16)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def draw_loss(metrics: list[dict], out: Path, plan_steps: list[int] = ()) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(m["step"], m["loss"]) for m in metrics if m.get("loss") is not None]
    val = [(m["step"], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), lw=0.8, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    for s in plan_steps:
        ax.axvline(s, color="grey", lw=0.5, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def make_report(run_dir: str | Path) -> dict[str, Path]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    history = load_plan_history(run_dir)
    metrics_path = run_dir / METRICS_FILE
    metrics = read_jsonl(metrics_path) if metrics_path.exists() else []
    last = max((m.get("step", 0) for m in metrics), default=None)
    out = {"heatmap": draw_heatmap(history, run_dir / "snip_heatmap.png", last)}
    if metrics:
        out["loss"] = draw_loss(metrics, run_dir / "loss.png", [s for s, _ in history])
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Draw SNIP's precision heat map and the loss curve.")
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    try:
        paths = make_report(args.run_dir)
    except ValueError as e:
        parser.error(str(e))
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
