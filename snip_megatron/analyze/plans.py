"""The plans of one measurement at a list of budgets, and the recipe rules at the same budgets.

Each budget is solved as a re-plan of the run would solve it (SnipController.plan_measurement: the
cost estimate of the measurement, TE's shape exclusions, the ILP), with the run's own budget kind
(SnipConfig.plan_choices: an FP4 fraction, an FP8 fraction on Hopper, or a speed-up) set to the
budget. The recipe rules (planner.baselines: last-fraction, first/last-k) are priced on the same
measured costs, at the same FP4 budgets: the same cost the planner minimises, so the picture
compares like with like.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from snip_megatron.config import SnipConfig
from snip_megatron.formats.precision import Precision
from snip_megatron.plan import Plan
from snip_megatron.report import plan_sum

BUDGET_FIELD = {"fp4_fraction": "fp4_budget", "fp8_fraction": "fp8_budget", "speedup": "speedup"}
"""The SnipConfig field each budget kind reads."""
RULES = ("last_fraction", "first_last_k")
"""The recipe rules drawn beside SNIP's plans (FP4 budgets only: they are FP4 rules)."""


def budget_kind(snip: SnipConfig) -> str:
    """The run's budget kind: fp4_fraction, fp8_fraction or speedup."""
    return snip.plan_choices().budget


def check_budgets(values: Sequence[float], kind: str) -> None:
    """ValueError naming --budgets where a value does not fit the kind: a fraction in [0, 1], or a
    speed-up >= 1."""
    for v in values:
        if not math.isfinite(v) or (kind == "speedup" and v < 1) or (kind != "speedup" and not 0 <= v <= 1):
            want = "a speed-up >= 1 (the run's budget is speedup)" if kind == "speedup" else \
                f"a fraction in [0, 1] (the run's budget is {kind})"
            raise ValueError(f"--budgets: {v:g} is not {want}")


def parse_budgets(text: str) -> list[float]:
    """'0.5,0.75,0.9' -> [0.5, 0.75, 0.9]; ValueError naming --budgets for anything else."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--budgets {text!r}: give numbers separated by commas, e.g. 0.5,0.75,0.9") from None
    if not values or not all(math.isfinite(v) for v in values):
        raise ValueError(f"--budgets {text!r}: give finite numbers separated by commas, e.g. 0.5,0.75,0.9")
    return sorted(set(values))


@dataclass
class BudgetPlan:
    """SNIP's plan at one budget, and what the measured costs predict for it."""

    budget: float
    plan: "Plan | None" = None
    cost: float = math.nan
    """Summed cost Q of the plan (the planner's objective)."""
    loss_increase: float = math.nan
    """Its loss-divergence part: the predicted relative loss increase dL / L."""
    speedup: float = math.nan
    """Modelled linear-GEMM speed-up over all-BF16."""
    fp4_fraction: float = math.nan
    fp8_fraction: float = math.nan
    """Fraction of the linear FLOPs in FP8 or lower."""
    high: list = field(default_factory=list)
    """The linears above the lowest precision the plan chooses from (forward order)."""
    solver: str = ""
    error: "str | None" = None
    """Why there is no plan (an infeasible budget)."""
    rules: dict = field(default_factory=dict)
    """Rule name -> predicted cost Q of its plan at this budget (None where the rule has none)."""


def config_at(snip: SnipConfig, budget: float) -> SnipConfig:
    """The run's config with its budget set to `budget`."""
    return dataclasses.replace(snip, **{BUDGET_FIELD[budget_kind(snip)]: budget})


def solve_budgets(stats, snip: SnipConfig, budgets: Sequence[float],
                  controller_for: Callable[[SnipConfig], object]) -> list[BudgetPlan]:
    """SNIP's plan of the measurement `stats` at every budget; `controller_for(config)`: the run's
    SnipController for a config (the loop's own, with its stages and exclusions)."""
    lowest = Precision.parse(snip.plan_choices().precisions[-1])  # precisions are listed bf16, fp8, fp4
    out = []
    for b in budgets:
        row = BudgetPlan(budget=b)
        out.append(row)
        try:
            controller = controller_for(config_at(snip, b))
            solved = controller.plan_measurement(stats)
        except ValueError as e:  # an infeasible budget: said in its row, the others still solved
            row.error = str(e)
            continue
        plan, result, costs = solved["plan"], solved["result"], solved["costs"]
        row.plan, row.solver = plan, result.solver
        row.cost, row.loss_increase = plan_sum(costs.costs, plan), plan_sum(costs.loss_div, plan)
        met = result.achieved
        row.speedup, row.fp4_fraction, row.fp8_fraction = met.speedup, met.fp4_fraction, met.fp8_fraction
        row.high = [k for k, p in plan.items() if p is not lowest]
        if budget_kind(snip) == "fp4_fraction":
            row.rules = rule_costs(costs, controller, snip, b)
    return out


def rule_costs(costs, controller, snip: SnipConfig, budget: float) -> dict:
    """Each recipe rule's plan at FP4 budget `budget`, priced on the measured `costs` (relaxed: a
    rule that keeps too much high gives FP4 to its kept linears last, so every budget has a plan);
    None where the rule's plan puts a linear in a precision the run cannot give it (the
    controller's exclusions: TE's shape rules, FP4 on multi-token prediction)."""
    from snip_megatron.planner.baselines import baseline_plan

    out = {}
    for rule in RULES:
        result = baseline_plan(rule, controller.keys, controller.flops, budget,
                               stages=controller.stages if snip.per_stage_budget else None,
                               k=snip.baseline_k, fraction=snip.baseline_fraction, relax=True,
                               gemm_cost=snip.gemm_costs())
        runnable = all(p not in controller.excluded.get(k, ()) for k, p in result.plan.items())
        out[rule] = plan_sum(costs.costs, result.plan) if runnable else None
    return out
