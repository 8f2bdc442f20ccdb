"""solve_plan: cost table + FLOP table + budget -> Plan, with CBC and the exact fallback."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import Plan, parse_key
from snip_megatron.planner.config import PlannerConfig
from snip_megatron.planner.costs import CostTable
from snip_megatron.planner.exact import solve_exact
from snip_megatron.planner.ilp import CBC_MISSING, SolverFailed, SolverUnavailable, describe_cbc, solve_ilp
from snip_megatron.planner.problem import Achieved, achieved, achieved_by_stage, build_knapsack


@dataclass(frozen=True)
class PlanResult:
    """A plan and how it was found."""

    plan: Plan
    """The chosen precision of every planned linear."""
    solver: str
    """Who answered: "cbc", "exact", or a baseline's name."""
    status: str
    """"optimal" (within gap_rel for CBC), "feasible" (budget met, optimality not proven: CBC stopped
    early and the exact fallback had to discretise), or "rule" for a baseline."""
    objective: float
    """Summed cost of the plan, switching penalties included (nan for baselines without costs)."""
    achieved: Achieved
    """FP4 and FP8-or-lower FLOP fractions and modelled speed-up of the whole plan."""
    per_stage: dict = field(default_factory=dict)
    """Stage -> Achieved, when stages were given."""
    seconds: float = 0.0
    """Wall-clock time of the solve, model building included."""
    switches: int = 0
    """Linears whose precision differs from the previous plan (0 without one)."""
    fallback_reason: str | None = None
    """Why CBC did not answer, when the exact solver did (None otherwise)."""
    detail: str | None = None
    """The solver's own word when the status is "feasible" (e.g. "cbc: feasible (TimeLimit)")."""


def solver_notice(config: PlannerConfig | None = None) -> str:
    """One line: the solver solve_plan runs with `config` (CBC's version and path), or that the
    exact fallback does, and why. Per-solve fallbacks (a crash, a timeout) are in each PlanResult."""
    config = config or PlannerConfig()
    if config.solver == "exact":
        return "exact solver (PlannerConfig.solver='exact')"
    cbc = describe_cbc(config)
    if cbc is not None:
        return cbc
    try:
        import pulp  # noqa: F401
    except Exception as exc:
        return f"exact solver: PuLP cannot be imported ({type(exc).__name__}: {exc}); pip install pulp[cbc]"
    if config.cbc_path is not None:
        return f"exact solver: PlannerConfig.cbc_path={config.cbc_path!r} is not a runnable CBC"
    return f"exact solver: {CBC_MISSING}"


_announce_lock = threading.Lock()
_announced = False


def _announce_solver(config: PlannerConfig) -> None:
    """Print solver_notice once per process, at the first solve (on rank 0 in training)."""
    global _announced
    with _announce_lock:
        if _announced:
            return
        _announced = True
    try:
        print(f"[snip] planner: {solver_notice(config)}", file=sys.stderr, flush=True)
    except Exception:  # a notice that cannot be written must not stop a solve
        pass


def solve_plan(costs: Mapping, flops: Mapping, config: PlannerConfig | None = None, *,
               previous: Mapping | None = None, stages: Mapping | None = None,
               pinned: Mapping | None = None) -> PlanResult:
    """The cheapest plan (sum of Q_l(p) + switching penalties) that meets the budget.

    costs: LayerKey -> {Precision: cost} or a CostTable; flops: LayerKey -> FLOPs (see flop_table);
    previous: the plan now running (for the switching penalty); stages: LayerKey -> pipeline stage
    (per-stage budgets, and per-stage reporting); pinned: LayerKey -> Precision, kept as given.
    Raises ValueError for bad input or an infeasible budget, nothing else: CBC being missing,
    failing or timing out hands the problem to the exact fallback, and the result says so.
    """
    config = config or PlannerConfig()
    _announce_solver(config)
    start = time.perf_counter()
    table = CostTable.of(costs)
    ks, flop_of = build_knapsack(table, flops, config, previous=previous, stages=stages, pinned=pinned)

    solver, reason, picks, status = "exact", None, None, None
    if config.solver != "exact":
        try:
            picks, status = solve_ilp(ks, config)
            solver = "cbc"
        except (SolverUnavailable, SolverFailed) as exc:
            reason = str(exc)
        except Exception as exc:  # a PuLP/CBC bug must not reach the training loop: fall back
            reason = f"CBC path raised {type(exc).__name__}: {exc}"
        if picks is not None and status != "optimal":
            # CBC stopped early (time limit): let the exact solver try, keep the better answer.
            exact_picks, exact_status = solve_exact(ks, config.exact_max_states)
            if exact_status == "optimal" or ks.objective(exact_picks) < ks.objective(picks):
                reason = f"CBC stopped early ({status})"
                picks, status, solver = exact_picks, exact_status, "exact"
    if picks is None:
        picks, status = solve_exact(ks, config.exact_max_states)
    detail = None if status in ("optimal", "feasible") else f"{solver}: {status}"
    status = "optimal" if status == "optimal" else "feasible"

    assignment = ks.assignment(picks)
    gemm = config.gemm_costs()
    prev = {parse_key(k): Precision.parse(v) for k, v in (previous or {}).items()}
    return PlanResult(
        plan=Plan(assignment),
        solver=solver,
        status=status,
        objective=ks.objective(picks),
        achieved=achieved(assignment, flop_of, gemm),
        per_stage=_per_stage(assignment, flop_of, gemm, stages),
        seconds=time.perf_counter() - start,
        switches=sum(1 for k, p in assignment.items() if k in prev and prev[k] != p),
        fallback_reason=reason,
        detail=detail,
    )


def _per_stage(assignment, flops, gemm, stages) -> dict:
    if stages is None:
        return {}
    stage_of = {parse_key(k): s for k, s in stages.items()}
    return achieved_by_stage(assignment, flops, gemm, stage_of)
