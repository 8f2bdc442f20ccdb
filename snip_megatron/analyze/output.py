"""What snip-analyze writes: the table it prints, each plan with its static recipes, a summary and
one picture (predicted cost against budget, SNIP's plans beside the recipe rules)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from snip_megatron.analyze.plans import RULES, BudgetPlan

KIND_WORDS = {"fp4_fraction": "FP4 fraction", "fp8_fraction": "FP8-or-lower fraction", "speedup": "speed-up"}
RULE_COLUMNS = {"last_fraction": "Q last-frac", "first_last_k": "Q first/last"}
"""Table columns: the predicted cost Q of each recipe rule's plan at the row's budget."""
RULE_WORDS = {"last_fraction": "last-fraction rule", "first_last_k": "first/last-k rule"}
SHOWN_HIGH = 4
"""Linears named per row of the table (the rest counted); the files list them all."""


def tag(kind: str, budget: float) -> str:
    """File-name part of one budget: fp4_0.75, fp8_0.9, speedup_1.5."""
    return f"{kind.split('_')[0]}_{budget:g}"


def _num(v: float, fmt: str) -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, fmt)


def table_text(rows: Sequence[BudgetPlan], kind: str, high_words: str) -> str:
    """The printed table: budget, predicted cost Q and loss increase, modelled speed-up, FLOP
    fractions, the rules' Q at the same budget, and the linears that stay high."""
    rules = [r for r in RULES if any(r in row.rules for row in rows)]
    head = (f"{'budget':>7} {'Q (cost)':>10} {'dL/L':>10} {'speed-up':>9} {'FP4':>6} {'FP8+':>6}"
            + "".join(f" {RULE_COLUMNS[r]:>13}" for r in rules) + f"  stay high ({high_words})")
    lines = [head]
    for row in rows:
        line = f"{row.budget:>7g} "
        if row.error is not None:
            lines.append(line + f"no plan: {row.error}")
            continue
        line += (f"{_num(row.cost, '.3e'):>10} {_num(row.loss_increase, '.3e'):>10} "
                 f"{_num(row.speedup, '.2f') + 'x':>9} {row.fp4_fraction:>6.0%} {row.fp8_fraction:>6.0%}")
        line += "".join(f" {_num(row.rules.get(r), '.3e'):>13}" for r in rules)
        names = [str(k) for k in row.high]
        shown = ", ".join(names[:SHOWN_HIGH]) + (f", +{len(names) - SHOWN_HIGH} more" if len(names) > SHOWN_HIGH else "")
        lines.append(line + f"  {len(names)}" + (f": {shown}" if names else ""))
    return "\n".join(lines)


def write_plans(out: Path, rows: Sequence[BudgetPlan], kind: str, *, origin: str, step: int, pp: int,
                vpp: "int | None", backend: str, sm: int, formats, layout_error: "str | None" = None,
                pattern: "str | None" = None) -> dict[float, dict[str, str]]:
    """Each plan as JSON (pinnable with --snip-plan / snip.plan) and as the static recipes of
    snip_megatron.export (`--te-precision-config-file` YAML, Bridge `quant_recipe`; `pattern`: a
    HybridModel's layer pattern, which names its modules); a recipe the layout or the GPU cannot
    take is left out, the reason recorded (`layout_error`: every one, for that reason).
    {budget: {what: file or why}}."""
    from snip_megatron.export import plan_text

    written = {}
    for row in rows:
        if row.plan is None:
            continue
        files = {}
        name = tag(kind, row.budget)
        where = f"SNIP plan of {origin} at step {step}, {KIND_WORDS[kind]} {row.budget:g}"
        for fmt, filename in (("json", f"plan_{name}.json"), ("megatron", f"te_precision_config_{name}.yaml"),
                              ("bridge", f"bridge_quant_recipe_{name}.yaml")):
            if fmt != "json" and layout_error is not None:
                files[fmt] = layout_error
                continue
            try:
                text = plan_text(row.plan, fmt, origin=where, pp=pp, vpp=vpp, backend=backend, sm=sm,
                                 extra={"step": step, "source": origin, "budget": {kind: row.budget}},
                                 fp8_recipe=formats.fp8_recipe, fp4_recipe=formats.fp4_recipe, pattern=pattern)
            except ValueError as e:
                files[fmt] = f"not written: {e}"
                continue
            (out / filename).write_text(text)
            files[fmt] = filename
        written[row.budget] = files
    return written


def summary(rows: Sequence[BudgetPlan], kind: str, files: dict, **about) -> dict:
    """analysis.json: what was measured and every row of the table, in full."""
    def num(v):
        return None if v is None or not math.isfinite(v) else v

    return {**about, "budget_kind": kind, "plans": [
        {"budget": r.budget, "error": r.error, "solver": r.solver, "predicted_cost": num(r.cost),
         "predicted_loss_increase": num(r.loss_increase), "modelled_speedup": num(r.speedup),
         "fp4_fraction": num(r.fp4_fraction), "fp8_fraction": num(r.fp8_fraction),
         "stay_high": [str(k) for k in r.high], "rules": {k: num(v) for k, v in r.rules.items()},
         "files": files.get(r.budget, {})} for r in rows]}


def draw(rows: Sequence[BudgetPlan], kind: str, path: Path, title: str) -> Path:
    """Predicted cost Q against the budget: SNIP's plans, and each recipe rule on the same costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    solved = [r for r in rows if r.plan is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    try:
        ax.plot([r.budget for r in solved], [r.cost for r in solved], "o-", color="tab:blue", lw=2,
                label="SNIP plan (ILP on the measured costs)")
        for rule, style in zip(RULES, ("s--", "^:")):
            points = [(r.budget, r.rules[rule]) for r in solved if r.rules.get(rule) is not None]
            if points:
                ax.plot(*zip(*points), style, label=RULE_WORDS[rule])
        ax.set_xlabel(f"budget ({KIND_WORDS[kind]} of linear FLOPs)" if kind != "speedup"
                      else "budget (modelled linear-GEMM speed-up)")
        ax.set_ylabel("predicted cost Q (sum over linears)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def write_all(out: Path, rows, kind: str, table: str, *, origin: str, step: int, measured: int, pp: int,
              vpp, backend: str, sm: int, formats, measure_s: float, layout_error: "str | None" = None,
              pattern: "str | None" = None) -> dict:
    """Every file of one analysis under `out`; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    files = write_plans(out, rows, kind, origin=origin, step=step, pp=pp, vpp=vpp, backend=backend, sm=sm,
                        formats=formats, layout_error=layout_error, pattern=pattern)
    about = {"checkpoint": origin, "step": step, "measured_microbatches": measured, "measure_s": measure_s,
             "layout": {"pp": pp, "vpp": vpp}, "recipes": {"backend": backend, "sm": sm}}
    doc = summary(rows, kind, files, **about)
    (out / "analysis.json").write_text(json.dumps(doc, indent=1))
    (out / "analysis.txt").write_text(table + "\n")
    draw(rows, kind, out / "analysis.png", f"{origin} at step {step}: {measured} micro-batches measured")
    return doc
