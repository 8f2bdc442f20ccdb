"""PlannerConfig: the budget, the allowed precisions and the solver settings of one re-plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from snip_megatron.formats.precision import Precision

BUDGETS = ("fp4_fraction", "fp8_fraction", "speedup")
"""Budget kinds: at least a FLOP fraction in FP4, at least a FLOP fraction in FP8 or lower (FP8 or
FP4, i.e. not BF16), or a modelled linear-GEMM speed-up over all-BF16."""
SOLVERS = ("auto", "cbc", "exact")

# The default `rho` of the two fraction budgets (PlannerConfig's, and SnipConfig's when unset).
DEFAULT_FP4_FRACTION = 0.75
"""budget="fp4_fraction": the paper's rho, 75% of the linear FLOPs in FP4."""
DEFAULT_FP8_FRACTION = 0.9
"""budget="fp8_fraction": 90% of the linear FLOPs in FP8 or lower (what Hopper plans: BF16 vs FP8)."""
DEFAULT_RHO = {"fp4_fraction": DEFAULT_FP4_FRACTION, "fp8_fraction": DEFAULT_FP8_FRACTION}

# Relative GEMM time per precision (Hopper FP8 = 2x BF16, Blackwell FP4 = 2x FP8).
DEFAULT_GEMM_COST = {Precision.BF16: 1.0, Precision.FP8: 0.5, Precision.FP4: 0.25}


def _default_gemm_cost() -> dict[Precision, float]:
    return dict(DEFAULT_GEMM_COST)


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """What one solve must achieve and how hard it may try."""

    budget: str = "fp4_fraction"
    """"fp4_fraction": at least `rho` of the linear FLOPs in FP4. "fp8_fraction": at least `rho` of
    them in FP8 or lower (FP8 or FP4: anything but BF16). "speedup": the modelled linear-GEMM time
    (FLOPs x `gemm_cost`) at least `speedup` times faster than all-BF16. In a run,
    SnipConfig.budget sets this."""
    rho: float | None = None
    """The FLOP fraction a fraction budget asks for: in FP4 (budget="fp4_fraction") or in FP8 or
    lower (budget="fp8_fraction"); unused by budget="speedup". None: that budget's default,
    DEFAULT_RHO (0.75 FP4, 0.9 FP8 or lower); `fraction` reads it. In a run, SnipConfig.fp4_budget
    or SnipConfig.fp8_budget sets this, whichever the budget reads."""
    speedup: float = 2.0
    """Target speed-up of the linear GEMMs over all-BF16 (budget="speedup"). In a run,
    SnipConfig.speedup sets this (1.5 there by default)."""
    gemm_cost: dict = field(default_factory=_default_gemm_cost)
    """Relative GEMM time per precision for the time model; every Precision needs a positive entry.
    In a run, SnipConfig.gemm_cost sets this (unset: the model of the run's GPU)."""
    allowed: tuple = (Precision.FP8, Precision.FP4)
    """Precisions the planner may choose (the paper: FP8 and FP4); add BF16 for a third choice.
    Pinned layers may hold any precision. In a run, SnipConfig.precisions sets this."""
    per_stage: bool = True
    """When `stages` are given to solve_plan, every pipeline stage must meet the budget on its own, so
    no stage becomes the bottleneck (the global budget then follows). In a run,
    SnipConfig.per_stage_budget sets this (off there by default)."""
    switch_penalty: float = 0.0
    """Cost added for each linear whose precision differs from the previous plan (same units as the
    cost table), so plans do not flap on measurement noise. 0 disables it. In a run,
    SnipConfig.switch_penalty sets this."""
    solver: str = "auto"
    """"auto": CBC, and the exact fallback if CBC is missing, fails or times out; "cbc": the same
    (the fallback still answers on failure, and the result says so); "exact": the fallback only."""
    time_limit_s: float = 10.0
    """Wall-clock limit of all CBC solves of one re-plan together (the stages share it), seconds.
    The exact fallback, when needed, runs after it (tens of ms on real layouts). In a run,
    SnipConfig.solver_time_limit_s sets this."""
    gap_rel: float = 1e-6
    """Relative optimality gap at which CBC may stop (CBC's own measure: relative to the cost above
    every layer's cheapest choice). In a run, SnipConfig.solver_gap sets this."""
    aggregate_layers: bool = True
    """Give CBC one integer per class of layers with equal budget weights (every layer of one
    shape) and choice: how many of them sit at that choice or above; the layers' own variables are
    continuous (exact, see planner/ilp.py), CBC's cuts are off and its cutoff increment tiny. CBC
    then no longer searches the equally good ways of spreading upgrades over a class. False: one
    binary per layer and choice with CBC's defaults (the earlier model, kept for comparison)."""
    threads: int | None = None
    """CBC threads; None lets CBC choose."""
    cbc_path: str | None = None
    """A CBC binary to use instead of the one PuLP finds (PuLP < 4 bundles one; PuLP >= 4 uses the
    `cbcbox` wheel, i.e. `pulp[cbc]`, or `cbc` on PATH)."""
    exact_max_states: int = 1 << 17
    """Budget states per pipeline stage of the exact dynamic programme. Integer FLOP tables fit exactly
    (the budget is counted in units of the FLOPs' greatest common divisor); beyond this the budget is
    discretised conservatively and the result's status says "feasible" instead of "optimal"."""

    def __post_init__(self) -> None:
        if self.budget not in BUDGETS:
            raise ValueError(f"PlannerConfig.budget={self.budget!r} is unknown; valid: {', '.join(BUDGETS)}")
        if self.rho is not None and (not isinstance(self.rho, (int, float)) or not 0.0 <= self.rho <= 1.0):
            raise ValueError(f"PlannerConfig.rho={self.rho!r} must be a fraction in [0, 1]")
        if not isinstance(self.speedup, (int, float)) or not math.isfinite(self.speedup) or self.speedup <= 0:
            raise ValueError(f"PlannerConfig.speedup={self.speedup!r} must be a positive number")
        cost = {Precision.parse(p): c for p, c in dict(self.gemm_cost).items()}
        for p in Precision:
            c = cost.get(p)
            if c is None or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
                raise ValueError(f"PlannerConfig.gemm_cost[{p.value}]={c!r} must be a positive number")
        allowed = tuple(Precision.parse(p) for p in self.allowed)
        if not allowed or len(set(allowed)) != len(allowed):
            raise ValueError(f"PlannerConfig.allowed={self.allowed!r} must list at least one precision, "
                             "each once")
        if not isinstance(self.switch_penalty, (int, float)) or not math.isfinite(self.switch_penalty) \
                or self.switch_penalty < 0:
            raise ValueError(f"PlannerConfig.switch_penalty={self.switch_penalty!r} must be >= 0")
        if self.solver not in SOLVERS:
            raise ValueError(f"PlannerConfig.solver={self.solver!r} is unknown; valid: {', '.join(SOLVERS)}")
        if not isinstance(self.time_limit_s, (int, float)) or not self.time_limit_s > 0:
            raise ValueError(f"PlannerConfig.time_limit_s={self.time_limit_s!r} must be > 0")
        if not isinstance(self.gap_rel, (int, float)) or not 0.0 <= self.gap_rel < 1.0:
            raise ValueError(f"PlannerConfig.gap_rel={self.gap_rel!r} must be in [0, 1)")
        if not isinstance(self.aggregate_layers, bool):
            raise ValueError(f"PlannerConfig.aggregate_layers={self.aggregate_layers!r} must be True or "
                             "False")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"PlannerConfig.threads={self.threads!r} must be None or a positive integer")
        if not isinstance(self.exact_max_states, int) or self.exact_max_states < 16:
            raise ValueError(f"PlannerConfig.exact_max_states={self.exact_max_states!r} must be an "
                             "integer >= 16")

    @property
    def fraction(self) -> float:
        """The fraction a fraction budget asks for: `rho`, or that budget's default when unset."""
        return DEFAULT_RHO.get(self.budget, DEFAULT_FP4_FRACTION) if self.rho is None else float(self.rho)

    # User spellings ("fp4", ["fp8", "fp4"]) are kept as given; these read them canonically.
    def allowed_precisions(self) -> tuple[Precision, ...]:
        """`allowed` as Precision members, in the given order."""
        return tuple(Precision.parse(p) for p in self.allowed)

    def gemm_costs(self) -> dict[Precision, float]:
        """`gemm_cost` keyed by Precision, as floats."""
        return {Precision.parse(p): float(c) for p, c in dict(self.gemm_cost).items()}
