"""SnipConfig: every knob of SNIP, validated once; the one owner of SNIP's configuration.

The `--snip*` flags (`snip_megatron.megatron.args`) are generated from these fields and their
docstrings, the Hydra recipes (`configs/snip/*.yaml`) only pick values of them, and the component
configs of one run (measurement, estimate, planner, formats) are built here and nowhere else.
No Megatron and no Hydra at import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, fields
from typing import Optional

from snip_megatron.formats.precision import (FP4_GRADIENT_ROUNDINGS, FP4_RECIPES, FP8_BLOCK_SCALES, FP8_FORMATS,
                                             FP8_RECIPES, Formats, Precision)
from snip_megatron.planner.baselines import BASELINES
from snip_megatron.planner.config import BUDGETS, DEFAULT_FP4_FRACTION, DEFAULT_FP8_FRACTION, DEFAULT_GEMM_COST

PRECISIONS = tuple(p.value for p in Precision)
CHOICES = {"fp8_recipe": FP8_RECIPES, "fp4_recipe": FP4_RECIPES, "initial_precision": PRECISIONS,
           "baseline": BASELINES, "precisions": PRECISIONS, "fp8_format": FP8_FORMATS,
           "fp8_block_scales": FP8_BLOCK_SCALES, "fp4_gradient_rounding": FP4_GRADIENT_ROUNDINGS,
           "budget": BUDGETS}
"""The valid values of SnipConfig's choice fields (the flags offer the same lists)."""
FP4_PLAN_PRECISIONS = ("fp8", "fp4")
"""SnipConfig.precisions when unset where FP4 runs (the paper's choice: FP8 or FP4 per linear)."""
FP8_PLAN_PRECISIONS = ("bf16", "fp8")
"""SnipConfig.precisions when unset on Transformer Engine before SM100 (no FP4 there)."""
FP4_FREE_BASELINES = ("uniform_bf16", "uniform_fp8")
"""Baselines that put no linear in FP4 (the others are rules for an FP4 budget)."""
BACKENDS = ("emulated", "te")
"""Where the planned linears run: SNIP's emulated linears, or Transformer Engine's (SnipConfig.resolved)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _parse_costs(value) -> dict[Precision, float]:
    """"bf16=1,fp8=0.5,fp4=0.25" (or a mapping) -> {Precision: cost}; every precision, each > 0."""
    items = value.items() if isinstance(value, dict) else (
        part.split("=", 1) if "=" in part else (part, None) for part in str(value).split(",") if part.strip())
    costs = {}
    for name, cost in items:
        try:
            p, c = Precision.parse(name), float(cost)
        except (TypeError, ValueError):
            raise ValueError(f"SnipConfig.gemm_cost={value!r} must read like bf16=1,fp8=0.5,fp4=0.25") from None
        if not math.isfinite(c) or c <= 0:
            raise ValueError(f"SnipConfig.gemm_cost: {p} costs {cost!r}; every cost must be a positive number")
        costs[p] = c
    missing = [p.value for p in Precision if p not in costs]
    if missing:
        raise ValueError(f"SnipConfig.gemm_cost={value!r} has no cost for {', '.join(missing)}; give all of "
                         "bf16, fp8, fp4")
    return costs


def _format_costs(costs: dict) -> str:
    return ",".join(f"{p.value}={costs[p]:g}" for p in Precision)


_BOOLS = ("enabled", "per_stage_budget", "pin_plan", "baseline_relax", "strict")
_FRACTIONS = ("fp4_budget", "fp8_budget", "baseline_fraction")
_POSITIVE_INTS = ("interval", "loss_guard_window", "baseline_k")
_NON_NEGATIVE_INTS = ("lag", "seed", "measure_micro_batches")
_NON_NEGATIVE = ("lambda_wd", "switch_penalty")


def check_field(name: str, v) -> None:
    """The rule of one SnipConfig field on its own (its type, range or choices), whatever the other
    fields hold; ValueError naming `SnipConfig.<name>`. SnipConfig checks every field with it, then
    how they combine; the `--snip*` flags check each value with it as they parse (snip_megatron.flags)."""
    def bad(rule: str):
        return ValueError(f"SnipConfig.{name} must be {rule}, got {v!r}")

    if name in _BOOLS and not isinstance(v, bool):
        raise ValueError(f"SnipConfig.{name} must be true or false, got {v!r}")
    if name in _FRACTIONS and v is not None and (not _is_number(v) or not 0.0 <= v <= 1.0):
        raise bad("a fraction in [0, 1]" if name != "baseline_fraction" else "in [0, 1]")
    if name in _POSITIVE_INTS and (not _is_int(v) or v < 1):
        raise bad("a positive integer")
    if name in _NON_NEGATIVE_INTS and (not _is_int(v) or v < 0):
        raise bad("a non-negative integer")
    if name in _NON_NEGATIVE and (not _is_number(v) or v < 0):
        raise bad("a number >= 0")
    if name in CHOICES and name != "precisions" and v is not None and v not in CHOICES[name]:
        raise ValueError(f"SnipConfig.{name}={v!r} is not valid; choose one of: {', '.join(CHOICES[name])}")
    if name == "precisions" and v is not None:
        SnipConfig._check_precisions(v)
    if name == "warmup":
        if not _is_number(v) or v < 0:
            raise bad("a fraction in [0, 1) or a step count >= 1")
        if v >= 1 and float(v) != int(v):
            raise ValueError(f"SnipConfig.warmup={v!r} is >= 1, so it is a step count and "
                             "must be a whole number (use a value < 1 for a fraction of the run)")
    if name == "speedup" and (not _is_number(v) or v < 1):
        raise bad("a number >= 1 (1: no speed-up asked)")
    if name == "gemm_cost" and v is not None:
        _parse_costs(v)
    if name == "plan" and v is not None and (not isinstance(v, str) or not v.strip()):
        raise bad("a file path")
    if name == "solver_time_limit_s" and (not _is_number(v) or v <= 0):
        raise bad("> 0")
    if name == "solver_gap" and (not _is_number(v) or not 0.0 <= v < 1.0):
        raise bad("in [0, 1)")
    if name == "noise_scale" and (not _is_number(v) or not 0.0 < v <= 1.0):
        raise bad("in (0, 1]")
    if name == "loss_guard_factor" and (not _is_number(v) or not (v == 0 or v > 1)):
        raise bad("0 (off) or > 1")


@dataclass(frozen=True)
class PlanChoices:
    """What the planner chooses from and the budget it meets (SnipConfig.plan_choices)."""

    precisions: list
    budget: str
    fp4_budget: Optional[float]
    fp8_budget: Optional[float]

    def as_fields(self) -> dict:
        """As SnipConfig field values."""
        return {"precisions": list(self.precisions), "budget": self.budget, "fp4_budget": self.fp4_budget,
                "fp8_budget": self.fp8_budget}


@dataclass(kw_only=True)
class SnipConfig:
    """How SNIP plans and re-plans the precision of every linear layer during training."""

    enabled: bool = False
    """Run SNIP at all. Off: every linear keeps the model's own precision (plain BF16 run)."""
    budget: Optional[str] = None
    """What a plan must achieve: fp4_fraction (at least `fp4_budget` of the linear FLOPs in FP4, the
    paper's budget), fp8_fraction (at least `fp8_budget` of them in FP8 or FP4: the BF16-or-FP8
    question of Hopper's Transformer Engine backend) or speedup (the modelled linear-GEMM time at
    least `speedup` times faster than all-BF16, with `gemm_cost`); none: fp8_fraction when
    `fp8_budget` is set or the precisions have no fp4, else fp4_fraction."""
    fp4_budget: Optional[float] = None
    """Fraction of the planned linear FLOPs that must run in FP4, in [0, 1] (the paper's rho; budget
    fp4_fraction); none: 0.75. Setting it asks for FP4, so the precisions then default to fp8,fp4
    on every GPU."""
    fp8_budget: Optional[float] = None
    """Fraction of the planned linear FLOPs that must run in FP8 or FP4, in [0, 1] (budget
    fp8_fraction); none: 0.9."""
    speedup: float = 1.5
    """budget=speedup: the modelled speed-up of the linear GEMMs over all-BF16 a plan must reach (>= 1)."""
    gemm_cost: Optional[str] = None
    """Relative GEMM time per precision for the modelled speed-up, e.g. bf16=1,fp8=0.5,fp4=0.25; none:
    what the run's GPU runs (Transformer Engine backend: by GPU generation), else that
    Blackwell-like model."""
    interval: int = 1000
    """Steps between two measurements (statistics step + two noise passes + solve)."""
    lag: int = 10
    """Steps between a measurement and applying its plan; the solve runs in the background meanwhile."""
    warmup: float = 0.2
    """Steps before the first measurement: a fraction of the run if < 1, else a step count."""
    precisions: Optional[list[str]] = None
    """Precisions the planner may choose from (at least two of bf16, fp8, fp4); budget=fp4_fraction
    needs fp4. None: what the planned linears run: fp8,fp4 on SNIP's emulated linears and on
    Transformer Engine from SM100 (Blackwell); bf16,fp8 on Transformer Engine before SM100 (Hopper
    runs FP4 only in emulation), unless an FP4 budget is asked."""
    fp8_recipe: str = "blockwise"
    """FP8 format: blockwise (1x128 / 128x128, DeepSeek-V3), tensorwise (current scaling) or mxfp8."""
    fp4_recipe: str = "nvfp4"
    """FP4 format: nvfp4 (E4M3 scale per 16 values) or mxfp4 (E8M0 scale per 32 values)."""
    fp8_format: Optional[str] = None
    """FP8 element formats: e4m3 everywhere or hybrid (E5M2 gradients); none: the recipe's own
    (blockwise and mxfp8: e4m3, tensorwise: hybrid). mxfp8 takes e4m3 only."""
    fp8_block_scales: Optional[str] = None
    """Blockwise FP8 block scales: fp32 or pow2 (rounded down to a power of two); none: what runs
    (Transformer Engine backend: TE's, pow2 unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1; else fp32)."""
    fp4_gradient_rounding: Optional[str] = None
    """FP4 gradient rounding: stochastic or nearest; none: what runs (nvfp4: stochastic, nearest
    where TE runs FP4 through its reference quantizer, before SM100, or with
    NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1; mxfp4: nearest)."""
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
    strict: bool = False
    """Stop the run when a measurement fails. Off: the failure is logged (a warning) and counted
    (snip/measure_failures), training goes on with its plan, and the same failure twice in a row
    stops re-planning."""
    seed: int = 1234
    """Seed of the noise passes and of the random baseline."""

    def __post_init__(self) -> None:
        for f in fields(self):  # each field alone first, then how they combine
            check_field(f.name, getattr(self, f.name))
        if self.lag >= self.interval:
            raise ValueError(f"SnipConfig.lag={self.lag} must be smaller than SnipConfig.interval={self.interval}: "
                             "a plan must be applied before the next measurement")
        if self.precisions is not None:
            self.precisions = self._check_precisions(self.precisions)
        try:
            self.formats  # noqa: B018 - the combination must be one the quantizers emulate
        except ValueError as e:
            raise ValueError(str(e).replace("Formats.", "SnipConfig.")) from None
        self.gemm_cost = None if self.gemm_cost is None else _format_costs(_parse_costs(self.gemm_cost))
        self._check_plan_choices(self.plan_choices())
        if self.pin_plan and self.plan is None:
            raise ValueError("SnipConfig.pin_plan is set but SnipConfig.plan is empty: give the plan to pin")
        if self.pin_plan and self.baseline is not None:
            raise ValueError(f"SnipConfig.pin_plan and SnipConfig.baseline={self.baseline!r} exclude each "
                             "other: a run follows either a saved plan or a baseline rule")

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
        if len(out) < 2:
            raise ValueError(f"SnipConfig.precisions={out} leaves the planner no choice; list two or more")
        # A fixed order, so equal sets compare and print equal.
        return [p for p in PRECISIONS if p in out]

    @property
    def asks_fp4(self) -> bool:
        """True when a setting asks for FP4 by itself: an FP4 budget, an FP4 format variant, or a
        baseline rule of FP4 (all but uniform_bf16 and uniform_fp8)."""
        return (self.budget == "fp4_fraction" or self.fp4_budget is not None or self.fp4_recipe != FP4_RECIPES[0]
                or self.fp4_gradient_rounding is not None or self._fp4_baseline)

    @property
    def _fp4_baseline(self) -> bool:
        return self.baseline is not None and self.baseline not in FP4_FREE_BASELINES

    def plan_choices(self, fp4_runs: bool = True) -> "PlanChoices":
        """The precisions and budget the planner works with, each field left unset filled for linears
        that run FP4 (`fp4_runs`: SNIP's emulated linears, Transformer Engine from SM100) or not
        (Transformer Engine before SM100): the one place these defaults are decided."""
        precisions = self.precisions
        if precisions is None:
            precisions = list(FP4_PLAN_PRECISIONS if fp4_runs or self.asks_fp4 else FP8_PLAN_PRECISIONS)
        budget = self.budget
        if budget is None:
            budget = "fp8_fraction" if self.fp8_budget is not None or "fp4" not in precisions else "fp4_fraction"
        fp4_budget, fp8_budget = self.fp4_budget, self.fp8_budget
        if budget == "fp4_fraction" and fp4_budget is None:
            fp4_budget = DEFAULT_FP4_FRACTION
        if budget == "fp8_fraction" and fp8_budget is None:
            fp8_budget = DEFAULT_FP8_FRACTION
        return PlanChoices(precisions=list(precisions), budget=budget, fp4_budget=fp4_budget, fp8_budget=fp8_budget)

    def _check_plan_choices(self, c: "PlanChoices") -> None:
        if self.fp4_budget is not None and self.fp8_budget is not None and self.budget is None:
            raise ValueError("SnipConfig.fp4_budget and SnipConfig.fp8_budget are both set: set SnipConfig.budget "
                             "to fp4_fraction or fp8_fraction (or drop one of them)")
        for name, kind in (("fp4_budget", "fp4_fraction"), ("fp8_budget", "fp8_fraction")):
            if getattr(self, name) is not None and c.budget != kind:
                raise ValueError(f"SnipConfig.{name} is set but the budget is {c.budget}: drop SnipConfig.{name}, "
                                 f"or set SnipConfig.budget='{kind}'")
        unused = [f"SnipConfig.{name}={getattr(self, name)!r}" for name, default in
                  (("fp4_recipe", FP4_RECIPES[0]), ("fp4_gradient_rounding", None)) if getattr(self, name) != default]
        if unused and "fp4" not in c.precisions and self.initial_precision != "fp4":
            raise ValueError(f"{', '.join(unused)} is set but SnipConfig.precisions={c.precisions} has no fp4: "
                             "drop it, or add fp4 to the precisions")
        if c.budget == "fp4_fraction" and "fp4" not in c.precisions:
            raise ValueError(f"SnipConfig.precisions={c.precisions} must include fp4: the FP4 budget needs it (or "
                             "set SnipConfig.budget='fp8_fraction' or 'speedup' to plan without FP4)")
        if c.budget == "speedup":
            self._check_speedup_reachable(self.gemm_costs(), c.precisions)
        if self._fp4_baseline and c.budget != "fp4_fraction":
            raise ValueError(f"SnipConfig.baseline={self.baseline!r} is a rule for an FP4 budget: it needs "
                             "SnipConfig.budget='fp4_fraction'")
        if self.initial_precision != "bf16" and self.initial_precision not in c.precisions:
            raise ValueError(f"SnipConfig.initial_precision={self.initial_precision!r} is not one of "
                             f"SnipConfig.precisions={c.precisions} (nor bf16)")

    def _check_speedup_reachable(self, costs: dict, precisions: list[str]) -> None:
        best = costs[Precision.BF16] / min(costs[Precision.parse(p)] for p in precisions)
        if self.speedup > best + 1e-9:
            raise ValueError(f"SnipConfig.speedup={self.speedup} cannot be reached: every linear in the "
                             f"fastest of {','.join(precisions)} gives {best:.2f}x with gemm_cost "
                             f"{_format_costs(costs)}; ask for at most {best:.2f}")

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
    def uses(self) -> tuple[Precision, ...]:
        """The precisions a linear of this run may be put in (the planner's and the initial one)."""
        precisions = self.plan_choices().precisions
        return tuple(p for p in Precision if p.value in precisions or p.value == self.initial_precision)

    @property
    def uses_names(self) -> tuple[str, ...]:
        """`uses` by name."""
        return tuple(p.value for p in self.uses)

    @property
    def formats(self) -> Formats:
        """The FP8/FP4 formats SNIP measures and the planned linears run (a variant left unset is
        the recipe's own, as SNIP's emulated linears run it; `resolved` fixes it for TE)."""
        return Formats(fp8_recipe=self.fp8_recipe, fp4_recipe=self.fp4_recipe, fp8_format=self.fp8_format,
                       fp8_block_scales=self.fp8_block_scales or "fp32",
                       fp4_gradient_rounding=self.fp4_gradient_rounding)

    def gemm_costs(self) -> dict[Precision, float]:
        """`gemm_cost` as {Precision: relative GEMM time}; unset: the default model (BF16 1, FP8 1/2, FP4 1/4)."""
        return dict(DEFAULT_GEMM_COST) if self.gemm_cost is None else _parse_costs(self.gemm_cost)

    def resolved(self, backend: str = "emulated", *, sm: "int | None" = None, environ=None,
                 support=None) -> "SnipConfig":
        """This config with every setting left to the hardware made explicit, for `backend`:
        "emulated" (SNIP's emulated linears: the plan's precisions and budget filled where FP4 runs,
        the recipes' own variants) or "te" (Transformer Engine on compute capability `sm`: the plan's
        precisions and budget of that GPU (no FP4 before SM100), TE's scale and rounding variants,
        read from `environ` as TE does at import, and the GEMM cost model of that GPU; `support`,
        the installed TE's own answers (snip_megatron.te.installed.TESupport), refuses what that TE
        cannot run here). ValueError listing every setting TE cannot run there, each with its fix,
        fields named SnipConfig.<field>. Resolve the config the user gave, once."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
        if not self.enabled:
            return self
        fp4_runs = True
        if backend == "te":
            from snip_megatron.te.gpu import fp4_unavailable

            fp4_runs = fp4_unavailable(FP4_RECIPES[0], sm) is None
        filled = dataclasses.replace(self, **self.plan_choices(fp4_runs).as_fields())
        if backend == "emulated":
            return filled
        from snip_megatron.te import gemm_cost, te_formats

        formats = te_formats(fp8_recipe=self.fp8_recipe, fp4_recipe=self.fp4_recipe, fp8_format=self.fp8_format,
                             fp8_block_scales=self.fp8_block_scales,
                             fp4_gradient_rounding=self.fp4_gradient_rounding, sm=sm, uses=filled.uses,
                             environ=environ, support=support, name_of=lambda f: f"SnipConfig.{f}")
        costs = self.gemm_cost or _format_costs(gemm_cost(sm))
        return dataclasses.replace(filled, fp8_block_scales=formats.fp8_block_scales,
                                   fp4_gradient_rounding=formats.fp4_gradient_rounding, gemm_cost=costs)

    def what_runs(self, sm: int) -> str:
        """One line for the start-up of a TE run on SM`sm` (call it on the resolved config): what
        each precision the run uses runs there, and the plan budget."""
        from snip_megatron.te import what_runs

        return f"{what_runs(self.formats, sm, self.uses)}; {self.budget_str()}"

    def budget_str(self) -> str:
        """The plan budget in words, e.g. "plan budget >= 75% of linear FLOPs in FP4, from fp8,fp4
        (GEMM cost bf16=1,fp8=0.5,fp4=0.25)"; the costs of the precisions the plan chooses from."""
        c = self.plan_choices()
        if c.budget == "fp4_fraction":
            what = f">= {c.fp4_budget:.0%} of linear FLOPs in FP4"
        elif c.budget == "fp8_fraction":
            what = f">= {c.fp8_budget:.0%} of linear FLOPs in FP8{' or FP4' if 'fp4' in c.precisions else ''}"
        else:
            what = f"modelled linear-GEMM speed-up >= {self.speedup:g}x over BF16"
        costs = self.gemm_costs()
        listed = ",".join(f"{p.value}={costs[p]:g}" for p in Precision if p.value in c.precisions or p is Precision.BF16)
        return f"plan budget {what}, from {','.join(c.precisions)} (GEMM cost {listed})"

    def measure_config(self):
        """The measurement's settings (snip_megatron.stats.MeasureConfig): the quantization errors
        of the FP8/FP4 precisions the plan chooses from."""
        from snip_megatron.stats.config import MeasureConfig

        quantized = tuple(p for p in self.plan_choices().precisions if p != Precision.BF16.value)
        return MeasureConfig(noise_frac=self.noise_scale, seed=self.seed, formats=self.formats,
                             micro_batches=self.measure_micro_batches or None, precisions=quantized)

    def estimate_config(self):
        """The cost estimator's settings (snip_megatron.estimate.EstimateConfig)."""
        from snip_megatron.estimate.config import EstimateConfig

        return EstimateConfig(lam=self.lambda_wd)

    def planner_config(self):
        """One re-plan's budget and solver settings (snip_megatron.planner.PlannerConfig)."""
        from snip_megatron.planner.config import PlannerConfig

        c = self.plan_choices()
        fraction = {"fp4_fraction": c.fp4_budget, "fp8_fraction": c.fp8_budget}.get(c.budget)
        return PlannerConfig(budget=c.budget, **({} if fraction is None else {"rho": fraction}),
                             speedup=self.speedup, gemm_cost=self.gemm_costs(),
                             allowed=tuple(Precision.parse(p) for p in c.precisions),
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
