"""SnipConfig: every knob of SNIP, validated once; the one owner of SNIP's configuration.

The `--snip*` flags (`snip_megatron.megatron.args`) are generated from these fields and their
docstrings, the Hydra recipes (`configs/snip/*.yaml`) only pick values of them, and the component
configs of one run (measurement, estimate, planner, formats) are built here and nowhere else.
No Megatron and no Hydra at import.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Optional

from snip_megatron.formats.precision import FP4_RECIPES, FP8_RECIPES, Formats, Precision
from snip_megatron.planner.baselines import BASELINES

PRECISIONS = tuple(p.value for p in Precision)
CHOICES = {"fp8_recipe": FP8_RECIPES, "fp4_recipe": FP4_RECIPES, "initial_precision": PRECISIONS,
           "baseline": BASELINES, "precisions": PRECISIONS}
"""The valid values of SnipConfig's choice fields (the flags offer the same lists)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(kw_only=True)
class SnipConfig:
    """How SNIP plans and re-plans the precision of every linear layer during training."""

    enabled: bool = False
    """Run SNIP at all. Off: every linear keeps the model's own precision (plain BF16 run)."""
    fp4_budget: float = 0.75
    """Fraction of the planned linear FLOPs that must run in FP4, in [0, 1] (the paper's rho)."""
    interval: int = 1000
    """Steps between two measurements (statistics step + two noise passes + solve)."""
    lag: int = 10
    """Steps between a measurement and applying its plan; the solve runs in the background meanwhile."""
    warmup: float = 0.2
    """Steps before the first measurement: a fraction of the run if < 1, else a step count."""
    precisions: list[str] = ("fp8", "fp4")  # type: ignore[assignment]  # a list after __post_init__
    """Precisions the planner may choose from (subset of bf16, fp8, fp4); fp4 is always needed."""
    fp8_recipe: str = "blockwise"
    """FP8 format: blockwise (1x128 / 128x128, DeepSeek-V3), tensorwise (current scaling) or mxfp8."""
    fp4_recipe: str = "nvfp4"
    """FP4 format: nvfp4 (E4M3 scale per 16 values) or mxfp4 (E8M0 scale per 32 values)."""
    per_stage_budget: bool = False
    """Enforce the FP4 budget on every pipeline stage, not only over the whole model."""
    plan: Optional[str] = None
    """Path of a saved plan (JSON/YAML) to start from instead of `initial_precision` everywhere."""
    pin_plan: bool = False
    """Keep `plan` for the whole run: never measure or re-plan (needs `plan`)."""
    baseline: Optional[str] = None
    """Run this fixed-rule baseline planner instead of SNIP's measured plan."""
    baseline_k: int = 1
    """first_last_k baseline: transformer layers kept out of FP4 at each end of the model."""
    baseline_fraction: float = 0.15
    """last_fraction baseline: fraction of the final layers kept out of FP4."""
    baseline_relax: bool = False
    """When a baseline's kept-high linears leave less than `fp4_budget`, give them FP4 last (in the rule's
    order) instead of refusing the budget (the rule is unchanged wherever it was feasible)."""
    initial_precision: str = "fp8"
    """Precision of every planned linear before the first plan (bf16, fp8 or fp4)."""
    lambda_wd: float = 0.3
    """Weight of the weight-divergence term against the loss-divergence term in the cost. 0.3: the
    best mean score against the long-horizon harm over two runs of bench/estimator_fidelity.py
    (docs/method.md, section 7; that truth is noisy, re-check on real models)."""
    switch_penalty: float = 0.0
    """Cost added for changing a layer's precision against the previous plan (>= 0)."""
    solver_time_limit_s: float = 60.0
    """Wall-clock limit of one ILP solve in seconds; the exact fallback runs past it."""
    solver_gap: float = 1e-4
    """Relative optimality gap at which the ILP solver stops, in [0, 1)."""
    noise_scale: float = 0.02
    """Noise std of the two noise passes as a fraction of each tensor's rms, in (0, 1]."""
    measure_micro_batches: int = 8
    """Micro-batches of the global batch a measurement uses, spread over the data-parallel replicas
    (0: every micro-batch). 8 keeps the ranking of the estimate within 0.99 Spearman of measuring
    all on llama_tiny (docs/method.md, section 10) at a fraction of the cost."""
    loss_guard_factor: float = 0.0
    """Revert a new plan when the loss exceeds this many times its recent mean (0 disables; else > 1)."""
    loss_guard_window: int = 50
    """Steps of loss history the loss guard compares against."""
    seed: int = 1234
    """Seed of the noise passes and of the random baseline."""

    def __post_init__(self) -> None:
        for name in ("enabled", "per_stage_budget", "pin_plan", "baseline_relax"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SnipConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if not _is_number(self.fp4_budget) or not 0.0 <= self.fp4_budget <= 1.0:
            raise ValueError(f"SnipConfig.fp4_budget must be a fraction in [0, 1], got {self.fp4_budget!r}")
        for name in ("interval", "loss_guard_window", "baseline_k"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"SnipConfig.{name} must be a positive integer, got {v!r}")
        for name in ("lag", "seed", "measure_micro_batches"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"SnipConfig.{name} must be a non-negative integer, got {v!r}")
        if self.lag >= self.interval:
            raise ValueError(f"SnipConfig.lag={self.lag} must be smaller than SnipConfig.interval={self.interval}: "
                             "a plan must be applied before the next measurement")
        if not _is_number(self.warmup) or self.warmup < 0:
            raise ValueError(f"SnipConfig.warmup must be a fraction in [0, 1) or a step count >= 1, "
                             f"got {self.warmup!r}")
        if self.warmup >= 1 and float(self.warmup) != int(self.warmup):
            raise ValueError(f"SnipConfig.warmup={self.warmup!r} is >= 1, so it is a step count and "
                             "must be a whole number (use a value < 1 for a fraction of the run)")
        self.precisions = self._check_precisions(self.precisions)
        for name in ("fp8_recipe", "fp4_recipe", "initial_precision"):
            self._check_choice(name)
        if self.initial_precision != "bf16" and self.initial_precision not in self.precisions:
            raise ValueError(f"SnipConfig.initial_precision={self.initial_precision!r} is not one of "
                             f"SnipConfig.precisions={self.precisions} (nor bf16)")
        if self.baseline is not None:
            self._check_choice("baseline")
        if self.plan is not None and (not isinstance(self.plan, str) or not self.plan.strip()):
            raise ValueError(f"SnipConfig.plan must be a file path, got {self.plan!r}")
        if self.pin_plan and self.plan is None:
            raise ValueError("SnipConfig.pin_plan is set but SnipConfig.plan is empty: give the plan to pin")
        if self.pin_plan and self.baseline is not None:
            raise ValueError(f"SnipConfig.pin_plan and SnipConfig.baseline={self.baseline!r} exclude each "
                             "other: a run follows either a saved plan or a baseline rule")
        if not _is_number(self.baseline_fraction) or not 0.0 <= self.baseline_fraction <= 1.0:
            raise ValueError(f"SnipConfig.baseline_fraction must be in [0, 1], got {self.baseline_fraction!r}")
        for name in ("lambda_wd", "switch_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or v < 0:
                raise ValueError(f"SnipConfig.{name} must be a number >= 0, got {v!r}")
        if not _is_number(self.solver_time_limit_s) or self.solver_time_limit_s <= 0:
            raise ValueError(f"SnipConfig.solver_time_limit_s must be > 0, got {self.solver_time_limit_s!r}")
        if not _is_number(self.solver_gap) or not 0.0 <= self.solver_gap < 1.0:
            raise ValueError(f"SnipConfig.solver_gap must be in [0, 1), got {self.solver_gap!r}")
        if not _is_number(self.noise_scale) or not 0.0 < self.noise_scale <= 1.0:
            raise ValueError(f"SnipConfig.noise_scale must be in (0, 1], got {self.noise_scale!r}")
        if not _is_number(self.loss_guard_factor) or not (self.loss_guard_factor == 0 or self.loss_guard_factor > 1):
            raise ValueError(f"SnipConfig.loss_guard_factor must be 0 (off) or > 1, got {self.loss_guard_factor!r}")

    def _check_choice(self, name: str) -> None:
        v, valid = getattr(self, name), CHOICES[name]
        if v not in valid:
            raise ValueError(f"SnipConfig.{name}={v!r} is not valid; choose one of: {', '.join(valid)}")

    @staticmethod
    def _check_precisions(value) -> list[str]:
        items = value.split(",") if isinstance(value, str) else list(value)
        out = []
        for p in items:
            p = str(p).strip().lower()
            if p not in PRECISIONS:
                raise ValueError(f"SnipConfig.precisions has unknown precision {p!r}; "
                                 f"valid: {', '.join(PRECISIONS)}")
            if p not in out:
                out.append(p)
        if "fp4" not in out:
            raise ValueError(f"SnipConfig.precisions={out} must include fp4: the FP4 budget needs it")
        if len(out) < 2:
            raise ValueError(f"SnipConfig.precisions={out} leaves the planner no choice; add fp8 or bf16")
        # A fixed order, so equal sets compare and print equal.
        return [p for p in PRECISIONS if p in out]

    def warmup_steps(self, train_iters: int) -> int:
        """The first measurement step: `warmup` as a step count, or its fraction of `train_iters`."""
        if self.warmup >= 1:
            return int(self.warmup)
        if not _is_int(train_iters) or train_iters < 1:
            raise ValueError(f"SnipConfig.warmup={self.warmup} is a fraction of the run, so the run "
                             f"length must be known; got train_iters={train_iters!r}")
        return int(round(self.warmup * train_iters))

    @property
    def measures(self) -> bool:
        """True when the controller measures and re-plans (not off, not pinned, not a baseline)."""
        return self.enabled and not self.pin_plan and self.baseline is None

    # -- the component configs of a run: built here, nowhere else ---------------------------------
    @property
    def formats(self) -> Formats:
        """The FP8/FP4 formats SNIP measures and the planned linears run."""
        return Formats(fp8_recipe=self.fp8_recipe, fp4_recipe=self.fp4_recipe)

    def measure_config(self):
        """The measurement's settings (snip_megatron.stats.MeasureConfig)."""
        from snip_megatron.stats.config import MeasureConfig

        return MeasureConfig(noise_frac=self.noise_scale, seed=self.seed, formats=self.formats,
                             micro_batches=self.measure_micro_batches or None)

    def estimate_config(self):
        """The cost estimator's settings (snip_megatron.estimate.EstimateConfig)."""
        from snip_megatron.estimate.config import EstimateConfig

        return EstimateConfig(lam=self.lambda_wd)

    def planner_config(self):
        """One re-plan's budget and solver settings (snip_megatron.planner.PlannerConfig)."""
        from snip_megatron.planner.config import PlannerConfig

        return PlannerConfig(rho=self.fp4_budget, allowed=tuple(Precision.parse(p) for p in self.precisions),
                             per_stage=self.per_stage_budget, switch_penalty=self.switch_penalty,
                             time_limit_s=self.solver_time_limit_s, gap_rel=self.solver_gap)

    def to_dict(self) -> dict:
        """Plain JSON/YAML-ready values (for logs, checkpoints and `--dry-run`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "SnipConfig":
        """Inverse of `to_dict`; unknown keys raise ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown SnipConfig field(s): {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        return cls(**values)
