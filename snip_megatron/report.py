"""What SNIP did in a run: the plan log (written during training, read here), the per-update
plan table, and the drawings (precision per layer over training, the loss curve).

    python -m snip_megatron.report <run dir>
    python -m snip_megatron.report export <run dir> --format megatron|bridge|json   (snip_megatron.export)

`PlanLog` writes `<run dir>/snip_plans.jsonl` (one line per plan the controller applied: step, plan,
the run's budget kind and what the plan achieves, solver, the cost table) and hands each line to the
run's own TensorBoard / W&B (snip_megatron.figures); `make_report` reads it with
`<run dir>/metrics.jsonl` (one line per training step: step, loss, optionally val_loss), writes
`<run dir>/snip_heatmap.png` and `<run dir>/loss.png`, and prints their paths.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path

from snip_megatron.figures import PlanFigures, heatmap_figure
from snip_megatron.formats.precision import Precision
from snip_megatron.plan import Plan
from snip_megatron.run_files import METRICS_FILE, PLANS_FILE, load_plan_history, read_jsonl



# -- the plan log: written by the controller (rank 0) ---------------------------------------------

class PlanLog:
    """One record per applied plan: a console line (and the plan table when something changed or
    was measured), a `snip_plans.jsonl` line when a run folder is given, and SNIP's figures in the
    run's loggers when it has any (`loggers`: snip_megatron.loggers.RunLoggers).

    The console line states the fraction the run's `budget` counts: "FP4 x% of linear FLOPs" for
    fp4_fraction and speedup, "FP8 or lower x% of linear FLOPs" for fp8_fraction and for a speedup
    plan without FP4 (with "(FP4 y%)" when the plan holds FP4). Each JSON line holds every figure: fp4_fraction, fp8_fraction, speedup.
    """

    def __init__(self, run_dir: "str | Path | None", flops: Mapping, log: Callable[[str], None] = print,
                 gemm_cost: "Mapping | None" = None, budget: str = "fp4_fraction", loggers=None):
        from snip_megatron.planner.config import BUDGETS, DEFAULT_GEMM_COST

        if budget not in BUDGETS:
            raise ValueError(f"PlanLog budget={budget!r} is unknown; valid: {', '.join(BUDGETS)}")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.flops = flops
        self.gemm_cost = dict(gemm_cost or DEFAULT_GEMM_COST)
        """The run's GEMM cost model (SnipConfig.gemm_costs): what "modelled speed-up" means here."""
        self.budget = budget
        """The run's budget kind (SnipConfig.budget, resolved): which fraction the console line states."""
        self._log = log
        self.figures = PlanFigures(loggers)
        """The plan's figures in the run's TensorBoard / W&B (none without loggers)."""

    def record(self, step: int, plan: Plan, previous: "Plan | None", info: dict) -> dict:
        """Log one applied plan; `info` holds the solver's result, costs and timings, if any."""
        from snip_megatron.planner.problem import achieved

        met = achieved(plan, self.flops, self.gemm_cost)  # the planner's own models
        fp4 = met.fp4_fraction
        row = {"step": step, "plan": {str(k): p.value for k, p in plan.items()},
               "digest": plan.digest(), "budget": self.budget, "fp4_fraction": fp4,
               "fp8_fraction": met.fp8_fraction, "speedup": met.speedup}
        result = info.get("result")
        if result is not None:
            row.update(solver=result.solver, status=result.status, objective=result.objective,
                       solve_s=info.get("solve_s"), measure_s=info.get("measure_s"),
                       measure_step=info.get("measure_step"), fallback=result.fallback_reason)
        if info.get("skipped"):
            row["nonfinite_layers"] = {str(k): list(v) for k, v in info["skipped"].items()}
        if info.get("event"):
            row["event"] = info["event"]
        changed = previous.diff(plan) if previous is not None else []
        row["changed"] = len(changed)
        if self.budget == "fp8_fraction" or (self.budget == "speedup" and fp4 == 0):  # no FP4 to count
            share = (f"FP8 or lower {met.fp8_fraction:.1%} of linear FLOPs"
                     + (f" (FP4 {fp4:.1%})" if fp4 > 0 else ""))
        else:
            share = f"FP4 {fp4:.1%} of linear FLOPs"
        self._log(f"[snip] step {step}: plan {plan.digest()[:12]}  {share}, "
                  f"modelled GEMM speed-up {row['speedup']:.2f}x, {len(changed)} linears changed"
                  + (f", solver {result.solver} ({result.status}) {info.get('solve_s', 0):.2f} s, "
                     f"measurement {info.get('measure_s', 0):.2f} s" if result is not None else ""))
        for key, fields in (info.get("skipped") or {}).items():
            self._log(f"[snip]   {key}: non-finite statistics ({', '.join(fields)}); kept {plan[key]}")
        costs = info.get("costs")
        if previous is not None and (costs is not None or changed):
            self._log(format_plan_table(plan, previous, costs))
        if costs is not None:
            row["table"] = [
                {"layer": str(k), "precision": plan[k].value, "previous": previous[k].value,
                 **{f"Q.{p.value}": costs.costs[k][p] for p in costs.costs[k]},
                 **{f"dL.{p.value}": costs.loss_div[k][p] for p in costs.loss_div[k]},
                 **{f"WD.{p.value}": costs.weight_div[k][p] for p in costs.weight_div[k]}}
                for k in plan]
            # What the cost table predicts the plan costs: the planner's objective without switching
            # penalties, and its loss-divergence part alone (the relative loss increase).
            row["predicted_cost"] = plan_sum(costs.costs, plan)
            row["predicted_loss_increase"] = plan_sum(costs.loss_div, plan)
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / PLANS_FILE, "a") as f:
                f.write(json.dumps(row, default=_json_default) + "\n")
        return row

    def publish(self, row: "dict | None", history: "list | None" = None) -> None:
        """Every rank, after each `record` (rank 0's row, None elsewhere; `history`: the plans so
        far, for the heat map): the plan's figures in the run's loggers, on the rank that holds them."""
        self.figures.publish(row, history)


def plan_sum(table: Mapping, plan: Plan) -> float:
    """Sum over the linears of `table[linear][its precision in plan]`; BF16 and absent entries count
    0, non-finite ones (layers whose statistics were not finite) are left out."""
    values = (table.get(k, {}).get(p, 0.0) for k, p in plan.items())
    return math.fsum(v for v in values if math.isfinite(v))


def format_plan_table(plan: Plan, previous: Plan, costs=None) -> str:
    """The per-update table: layer, precision, previous precision, Q, dL, WD (FP4 and FP8, those of
    them the cost table has: a BF16/FP8 plan shows FP8's). The layer column fits the longest key
    (an MTP linear's "1.mtp.linear_kv_down_proj")."""
    shown = (Precision.FP4, Precision.FP8)
    if costs is not None:
        shown = tuple(p for p in shown if any(p in row for row in costs.costs.values())) or shown
    width = max([16] + [len(str(key)) + 2 for key in plan])
    head = f"  {'layer':<{width}}{'now':>6}{'was':>6}"
    if costs is not None:
        head += "".join(f"{'Q.' + p.value:>11}{'dL.' + p.value:>11}{'WD.' + p.value:>11}" for p in shown)
    lines = [head]
    for key in plan:
        mark = " *" if plan[key] != previous[key] else ""
        line = f"  {str(key):<{width}}{plan[key].value:>6}{previous[key].value:>6}"
        if costs is not None:
            for p in shown:
                line += "".join(f"{getattr(costs, part)[key].get(p, math.nan):>11.3g}"
                                for part in ("costs", "loss_div", "weight_div"))
        lines.append(line + mark)
    return "\n".join(lines)


def _json_default(obj):
    if isinstance(obj, float):
        return None if not math.isfinite(obj) else obj
    if hasattr(obj, "_asdict"):
        return obj._asdict()
    if isinstance(obj, Precision):
        return obj.value
    return str(obj)


# -- drawing ---------------------------------------------------------------------------

def draw_heatmap(history: list[tuple[int, Plan]], out: Path, last_step: int | None = None) -> Path:
    """The heat map of `heatmap_figure`, as a PNG at `out`."""
    fig = heatmap_figure(history, last_step)
    import matplotlib.pyplot as plt

    fig.savefig(out)
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
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:  # the plan as a static per-module config
        from snip_megatron.export import main as export_main

        return export_main(argv[1:])
    parser = argparse.ArgumentParser(description="Draw SNIP's precision heat map and the loss curve "
                                     "(`export RUN_DIR --format ...`: the plan as a per-module config).")
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
