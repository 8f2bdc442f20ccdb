"""SNIP's figures of each applied plan, in the run's own TensorBoard and W&B (snip_megatron.loggers).

At every plan (the initial one, each re-plan, a loss-guard revert):

    snip/flops_fp4, snip/flops_fp8, snip/flops_bf16   fraction of the linear FLOPs in each precision
    snip/modelled_speedup                             modelled linear-GEMM speed-up over all-BF16
    snip/linears_changed                              linears whose precision the plan changed
    snip/measure_s, snip/solve_s                      the measurement's and the solver's wall time
    snip/predicted_cost                               summed cost Q of the plan (the planner's objective)
    snip/predicted_loss_increase                      its loss-divergence part: predicted dL / L
    snip/plan_heatmap (image)                         precision per linear over training so far
    snip/plan_table (text / W&B table)                layer, linear, precision, previous, Q, dL, WD

(the last four scalars only after a measurement). The controller plans on rank 0, and loops create
their writers on another rank (Megatron: the last), so `PlanFigures.publish` runs on every rank
and sends rank 0's row to the others as JSON (one broadcast of its length, one of its bytes) when
the run has a logger and more than one rank; a run without loggers costs nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

from snip_megatron.formats.precision import Precision
from snip_megatron.loggers import RunLoggers
from snip_megatron.plan import Plan, parse_key

HEATMAP_TAG = "snip/plan_heatmap"
TABLE_TAG = "snip/plan_table"
_TIMED = {"measure_s": "snip/measure_s", "solve_s": "snip/solve_s", "predicted_cost": "snip/predicted_cost",
          "predicted_loss_increase": "snip/predicted_loss_increase"}
"""PlanLog row fields written only when the plan came from a measurement, and their tags."""
_CODE = {Precision.BF16: 2, Precision.FP8: 1, Precision.FP4: 0}
"""The heat map's colour index of each precision."""


def plan_scalars(row: Mapping) -> dict[str, float]:
    """The scalars of one PlanLog row (report.PlanLog.record)."""
    fp4, fp8_or_lower = float(row["fp4_fraction"]), float(row["fp8_fraction"])
    out = {"snip/flops_fp4": fp4, "snip/flops_fp8": fp8_or_lower - fp4, "snip/flops_bf16": 1.0 - fp8_or_lower,
           "snip/modelled_speedup": float(row["speedup"]), "snip/linears_changed": float(row.get("changed", 0))}
    for field, tag in _TIMED.items():
        value = row.get(field)
        if value is not None and math.isfinite(float(value)):
            out[tag] = float(value)
    return out


def plan_table(row: Mapping) -> tuple[list[str], list[list]]:
    """(columns, rows): every planned linear's layer, linear name and precision, with the previous
    precision and the measured costs (Q, dL, WD per precision) when the plan came from a measurement."""
    measured = row.get("table")
    if not measured:
        return ["layer", "linear", "precision"], [[*parse_key(k), p] for k, p in row["plan"].items()]
    costs = [c for c in measured[0] if c not in ("layer", "precision", "previous")]
    return (["layer", "linear", "precision", "previous", *costs],
            [[*parse_key(e["layer"]), e["precision"], e["previous"], *(e.get(c) for c in costs)] for e in measured])


def heatmap_figure(history: list[tuple[int, Plan]], last_step: int | None = None, dpi: int = 120):
    """Layers (rows, forward order) x training steps (columns), colour = precision: a matplotlib
    Figure (the caller saves or renders it, then closes it)."""
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
    fig, ax = plt.subplots(figsize=(8, max(3, 0.16 * len(keys) + 1.5)), dpi=dpi)
    cmap = ListedColormap(["#d62728", "#ff7f0e", "#1f77b4"])  # fp4, fp8, bf16
    ax.pcolormesh(edges, np.arange(len(keys) + 1), grid, cmap=cmap, vmin=-0.5, vmax=2.5)
    ax.set_yticks(np.arange(len(keys)) + 0.5)
    ax.set_yticklabels([str(k) for k in keys], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("training step")
    ax.set_title("SNIP precision per linear layer (red FP4, orange FP8, blue BF16)")
    fig.tight_layout()
    return fig


def heatmap_image(history: Sequence[tuple[int, Plan]]):
    """The heat map of `history` (`heatmap_figure`) as an H x W x 3 uint8 array."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig = heatmap_figure(list(history), dpi=80)
    try:
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    finally:
        plt.close(fig)


def write_plan(writers: Sequence, row: Mapping, history: Sequence[tuple[int, Plan]]) -> None:
    """One plan's scalars, the heat map of `history` (the plans so far) and the plan's table into
    every writer (snip_megatron.loggers adapters)."""
    step = int(row["step"])
    scalars, image, (columns, rows) = plan_scalars(row), heatmap_image(history), plan_table(row)
    for writer in writers:
        writer.scalars(step, scalars)
        writer.image(step, HEATMAP_TAG, image)
        writer.table(step, TABLE_TAG, columns, rows)
        writer.flush()


class PlanFigures:
    """Writes each plan of a run to its loggers as it is applied."""

    def __init__(self, loggers: "RunLoggers | None" = None):
        self.loggers = loggers or RunLoggers()

    def publish(self, row: "Mapping | None", history: "Sequence[Mapping] | None" = None) -> None:
        """Every rank, at every plan (`row`: PlanLog's on rank 0, None elsewhere; `history`: the
        controller's plans so far on this rank, {"step", "plan"} each, this one last; None: this
        one only). A logger that fails is reported on this rank and never stops training."""
        if not self.loggers.enabled:
            return
        row = _from_rank_0(row)
        writers = self.loggers.writers()
        if not writers:
            return
        plans = [(int(h["step"]), Plan(h["plan"])) for h in (history or [row])]
        try:
            write_plan(writers, row, plans)
        except Exception as exc:  # noqa: BLE001 - a logger's failure never stops training
            print(f"[snip] writing the plan of step {row['step']} to the run's loggers failed: "
                  f"{type(exc).__name__}: {exc}", flush=True)


def _from_rank_0(row: "Mapping | None") -> dict:
    """Rank 0's row on every rank (as JSON bytes: nothing pickled); the row itself in one process."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(row)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    data = json.dumps(row, default=str).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data
              else torch.empty(int(size[0]), dtype=torch.uint8, device=device))
    dist.broadcast(buffer, src=0)
    return json.loads(buffer.cpu().numpy().tobytes().decode())
