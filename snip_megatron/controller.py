"""The SNIP controller: measure, estimate, solve and apply precision plans during training.

The loop of DESIGN section 6, as a step hook (snip_megatron.hooks) that both training loops call:

- before the first measurement: the initial plan (`initial_plan`: a saved plan, or every planned
  linear in `initial_precision`); a resumed run continues with its checkpoint's plan;
- measurement step t (before the optimizer step of t, on t's batch, on every rank): statistics
  and the noise pass(es), reduced to global rank 0;
- rank 0 estimates costs and solves the ILP in a background thread while training goes on;
- apply step t + lag (at the start of that step): every rank joins one broadcast of the plan
  from rank 0 (rank 0 waits for the solver if needed, up to its time limit) and applies its slice.
  With lag 0 the plan is applied right after the measurement, before step t trains.

Steps that neither measure, apply nor close a loss-guard window issue no collective.
Failures do not stop training (except a failed measurement in strict mode): a layer with
non-finite statistics keeps its precision; a solver that raises, hangs past its limit or finds
nothing keeps the previous plan; an exception while measuring or applying a plan, on any rank,
becomes one rank-agreed decision (one all-reduce of a flag) to skip that update and keep the
previous plan, and the same measurement failure twice in a row stops re-planning
(snip_megatron.failures); the optional loss guard reverts a plan after which the loss rose by
more than `loss_guard_factor`. What the controller did is written by
`snip_megatron.report.PlanLog`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from snip_megatron import defaults
from snip_megatron.config import SnipConfig
from snip_megatron.failures import MeasurementFailures, all_reduce_max, collective_device
from snip_megatron.formats.precision import Precision
from snip_megatron.hooks import StepContext, StepHook
from snip_megatron.models import gpt
from snip_megatron.models.inventory import Inventory
from snip_megatron.plan import LayerKey, Model, Plan, parse_key
from snip_megatron.shapes import ModelShape

COST_EMA = 0.5
"""Weight of a new measurement in the smoothed cost table (the rest is the previous smoothed
value): one-batch statistics are noisy, and plans should not flap on that noise."""
STATE_VERSION = 1


@dataclass(frozen=True)
class Schedule:
    """When to measure and when to apply: first measurement, then every `interval` steps."""

    first: int
    interval: int
    lag: int

    def is_measure_step(self, step: int) -> bool:
        return step >= self.first and (step - self.first) % self.interval == 0

    def next_measure_step(self, step: int) -> int:
        """The first measurement step at or after `step`."""
        if step <= self.first:
            return self.first
        return self.first + -(-(step - self.first) // self.interval) * self.interval


@dataclass
class _Pending:
    """A measurement whose plan is not applied yet."""

    measure_step: int
    apply_step: int
    started: float
    thread: threading.Thread | None = None
    result: dict | None = None   # filled by the background thread on rank 0
    error: str | None = None
    reported: bool = False


def initial_plan(config: SnipConfig, model: Model) -> tuple[Plan, str]:
    """The plan a run starts with, and where it came from (the one place this is decided).

    SNIP off: BF16 everywhere. A saved plan (`config.plan`, pinned or not), checked against the
    model. Else every planned linear in `initial_precision`. A resumed run replaces it with its
    checkpoint's plan (`SnipController.load_state_dict`), except a pinned plan, which always wins.
    `model`: the model's inventory (or a dense GPT's layer count).
    """
    if not config.enabled:
        return Plan.uniform(model, Precision.BF16), "off"
    if config.plan:
        kind = "pinned" if config.pin_plan else "file"
        return Plan.load_for(config.plan, model), f"{kind} {config.plan}"
    return Plan.uniform(model, config.initial_precision), f"initial {config.initial_precision}"


class SnipController(StepHook):
    """Re-plans the precision of every planned linear during training (see module docstring).

    `measure(ctx, step) -> StatsTable | None` runs the measurement on every rank and returns the
    reduced table on global rank 0 (None elsewhere). `estimate` maps a table to a CostEstimate,
    `solve` a cost table to a PlanResult, `apply(ctx, plan)` applies this rank's slice of a plan
    (default: `ctx.set_plan`). The defaults are SNIP's own, built from `config`; tests inject fakes.
    `loggers` (snip_megatron.loggers.RunLoggers): the run's TensorBoard / W&B, where each plan's
    figures go (snip_megatron.figures); none: the console and `run_dir` only.
    """

    name = "snip"
    """Key of the controller's state in the loop's checkpoints (snip_megatron.hooks.StepHook)."""

    def __init__(self, config: SnipConfig, shape: ModelShape, *, total_steps: int,
                 run_dir: str | Path | None = None, tokens_per_step: int | None = None,
                 stages: Mapping[LayerKey, int] | None = None, log: Callable[[str], None] = print,
                 excluded: Mapping[LayerKey, Mapping] | None = None, loggers=None,
                 measure: Callable | None = None, estimate: Callable | None = None,
                 solve: Callable | None = None, apply: Callable | None = None,
                 inventory: Inventory | None = None):
        from snip_megatron.planner.flops import flop_table
        from snip_megatron.report import PlanLog

        self.config = config
        self.shape = shape
        self.inventory = inventory if inventory is not None else gpt.inventory(shape)
        """The planned linears (default: the dense GPT of `shape`)."""
        self.keys = list(self.inventory.keys())
        self.flops = flop_table(self.inventory, shape.seq_length if tokens_per_step is None else tokens_per_step)
        self.stages = dict(stages) if stages else None
        self._log = log
        self.plan_log = PlanLog(run_dir, self.flops, log=log, gemm_cost=config.gemm_costs(),
                                budget=config.plan_choices().budget, loggers=loggers)
        self._measure = measure or defaults.measure(config)
        self._estimate = estimate or defaults.estimate(config)
        self._solve = solve or defaults.solve(config)
        self._apply = apply or (lambda ctx, plan: ctx.set_plan(plan))
        self.schedule = Schedule(first=config.warmup_steps(total_steps), interval=config.interval,
                                 lag=config.lag)
        self.excluded = {parse_key(k): {Precision.parse(p) for p in ps} for k, ps in (excluded or {}).items()}
        """Precisions the backend cannot run per linear (TE's shape rules): never planned."""
        self.plan, self.plan_source = initial_plan(config, self.inventory)
        if self.excluded:
            if config.measures:
                self._check_excluded_budget()
            self.plan = self._runnable(self.plan, refuse=config.plan is not None)
        self.history: list[dict] = []
        self.smoothed_costs: dict[LayerKey, dict[Precision, float]] | None = None
        self.next_measure = self.schedule.first if config.measures or config.baseline else None
        self.pending: _Pending | None = None
        self.ctx: StepContext | None = None
        self._guard: dict | None = None
        self._recent_losses: list[float] = []
        self.failures = MeasurementFailures(config.strict, loggers, log=self.log)
        """Failed measurements: counted, and bounded (snip_megatron.failures)."""

    # -- set-up ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def log(self, msg: str) -> None:
        if self.rank == 0:
            self._log(f"[snip] {msg}")

    # -- precisions the backend cannot run for a linear -------------------------------------------
    def _fallback(self, key: LayerKey) -> Precision:
        """The precision a linear runs when its plan's is excluded: FP8 if it may, else BF16."""
        ok_fp8 = Precision.FP8 not in self.excluded.get(key, ()) and Precision.FP8.value in self.config.uses_names
        return Precision.FP8 if ok_fp8 else Precision.BF16

    def _runnable(self, plan: Plan, *, refuse: bool = False) -> Plan:
        """`plan` with every excluded precision replaced by the linear's fallback (ValueError naming
        them when `refuse`: a saved plan is run as it is or not at all)."""
        bad = {k: p for k, p in plan.items() if p in self.excluded.get(k, ())}
        if bad and refuse:
            raise ValueError("the plan puts linears in precisions the backend cannot run for their shapes: "
                             + ", ".join(f"{k}={p.value}" for k, p in list(bad.items())[:6])
                             + "; re-plan without them, or change the layout")
        return plan.replace({k: self._fallback(k) for k in bad}) if bad else plan

    def _runnable_costs(self, table: Mapping, pinned: dict) -> dict:
        """The cost table without excluded precisions; a linear left without an allowed precision
        is pinned to its fallback."""
        allowed = set(self.config.uses_names)
        out = {}
        for key, row in table.items():
            out[key] = {p: q for p, q in row.items() if p not in self.excluded.get(key, ())}
            if key not in pinned and not any(p.value in allowed for p in out[key]):
                pinned[key] = self._fallback(key)
        return out

    def _check_excluded_budget(self) -> None:
        """Refuse at construction a budget the linears the backend can run cannot meet."""
        from snip_megatron.planner.problem import build_knapsack

        config = self.config.planner_config()
        table = {k: {p: 0.0 for p in Precision if p.value in self.config.uses_names} for k in self.keys}
        pinned: dict = {}
        table = self._runnable_costs(table, pinned)
        try:
            build_knapsack(table, self.flops, config, stages=self.stages, pinned=pinned)
        except ValueError as e:
            knob = {"fp4_fraction": "SnipConfig.fp4_budget", "fp8_fraction": "SnipConfig.fp8_budget"}.get(
                config.budget, "SnipConfig.speedup")
            raise ValueError(f"the linears the backend can run for their shapes cannot meet the plan budget: {e}; "
                             f"lower {knob}") from None

    def on_train_start(self, ctx: StepContext) -> None:
        """After set-up and any resume: check the loop runs SNIP's formats, apply the plan."""
        theirs = ctx.formats
        if theirs != self.config.formats:
            raise ValueError(f"SNIP measures {self.config.formats.short_str()} but the training loop's "
                             f"planned linears run {theirs.short_str()}: give both the same formats "
                             "(TrainConfig.formats = SnipConfig.formats)")
        self.attach(ctx, step=ctx.step)

    def attach(self, ctx: StepContext, step: int = 0) -> None:
        """Take the loop's context and apply the current plan to this rank's linears."""
        self.ctx = ctx
        self._apply(ctx, self.plan)
        if not self.history:  # a fresh controller (also on weights of a checkpoint without SNIP's state)
            self._record(step, self.plan, previous=None, info={"event": "initial"})

    # -- step hooks -----------------------------------------------------------------------------
    def on_step_start(self, ctx: StepContext, step: int) -> None:
        if ctx is not None:
            self.ctx = ctx
        self._report_background_error()
        if self.pending is not None and step >= self.pending.apply_step:
            self._apply_pending(step)
        if self.next_measure is not None and step == self.next_measure:
            self.next_measure = step + self.schedule.interval  # kept on: a resumed run measures again
            if self.failures.stopped is None:
                self._start_measurement(step)
            if self.pending is not None and self.pending.apply_step <= step:
                self._apply_pending(step)  # lag 0: the new plan trains this very step

    def on_step_end(self, ctx: StepContext, step: int, metrics: Mapping | None = None) -> None:
        loss = (metrics or {}).get("loss")
        if loss is not None and math.isfinite(float(loss)):
            self._recent_losses = (self._recent_losses + [float(loss)])[-self.config.loss_guard_window:]
        if self._guard is not None:
            if loss is not None:
                self._guard["after"].append(float(loss))
            if step >= self._guard["check_step"]:
                self._close_guard(step)

    # -- measurement and background solve ---------------------------------------------------------
    def _start_measurement(self, step: int) -> None:
        start = time.perf_counter()
        stats = None
        if self.config.measures or self.config.baseline == "min_rel_error":
            from snip_megatron.stats.measure import MeasurementFailed

            error = None
            try:
                stats = self._measure(self.ctx, step)
            except MeasurementFailed as exc:  # every rank raised it together, with its own cause if any
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - a failed measurement stops training in strict mode only
                error = f"{type(exc).__name__}: {exc}"
            if self.failures.agree(step, error):
                return
        measure_s = time.perf_counter() - start
        pending = _Pending(measure_step=step, apply_step=step + self.schedule.lag, started=time.perf_counter())
        if self.rank == 0:
            pending.thread = threading.Thread(target=self._plan_in_background,
                                              args=(pending, stats, self.plan, measure_s),
                                              name="snip-solver", daemon=True)
            pending.thread.start()
        self.pending = pending

    def _any_rank(self, failed: bool, what: str, error: str | None) -> bool:
        """One all-reduce (MAX) of a failure flag: True on every rank when any rank failed.
        The failing rank logs its cause; rank 0 says the update is skipped."""
        if error is not None:
            self._log(f"[snip] rank {self.rank}: {what} failed: {error}")
        flag = bool(all_reduce_max(int(failed)))
        if flag:
            self.log(f"{what} failed on {'this' if failed else 'another'} rank; skipping this update, "
                     "training continues with the current plan")
        return flag

    def _plan_in_background(self, pending: _Pending, stats, previous: Plan, measure_s: float) -> None:
        try:
            pending.result = self._plan_from(stats, previous, measure_s)
        except Exception as exc:  # reported on the next step; training goes on with the old plan
            pending.error = f"{type(exc).__name__}: {exc}"

    def plan_measurement(self, stats) -> dict:
        """The plan a re-plan makes from one measurement's table `stats` (estimate, then solve
        against the current plan), in the calling thread: {"plan", "result", "costs", "skipped",
        "solve_s"}. On a fresh controller the costs are the measurement's own (nothing smoothed
        in); snip-analyze solves one checkpoint's measurement this way."""
        return self._plan_from(stats, self.plan, 0.0)

    def _plan_from(self, stats, previous: Plan, measure_s: float) -> dict:
        start = time.perf_counter()
        cfg = self.config
        if cfg.baseline is not None:
            from snip_megatron.planner.baselines import baseline_plan

            rel_error = None
            if stats is not None:
                from snip_megatron.estimate.cost import proxy_table

                rel_error = proxy_table(stats)
            result = baseline_plan(cfg.baseline, self.keys, self.flops, cfg.plan_choices().fp4_budget,
                                   rel_error=rel_error, seed=cfg.seed, k=cfg.baseline_k,
                                   fraction=cfg.baseline_fraction, stages=self.stages,
                                   relax=cfg.baseline_relax, gemm_cost=cfg.gemm_costs(),
                                   budget=cfg.plan_choices().budget)
            return {"plan": self._runnable(result.plan), "result": result, "costs": None, "measure_s": measure_s,
                    "solve_s": time.perf_counter() - start, "skipped": {}}
        costs = self._estimate(stats)
        skipped = dict(getattr(costs, "nonfinite", {}) or {})
        table = self._smooth(costs.costs, skipped)
        pinned = {k: previous[k] for k in skipped}
        if self.excluded:
            table = self._runnable_costs(table, pinned)
        result = self._solve(table, self.flops, previous=previous, stages=self.stages, pinned=pinned)
        return {"plan": result.plan, "result": result, "costs": costs, "measure_s": measure_s,
                "solve_s": time.perf_counter() - start, "skipped": skipped}

    def _smooth(self, costs: Mapping, skipped: Mapping) -> dict:
        """EMA of finite costs across measurements; layers with non-finite statistics keep their
        previous smoothed costs (or 0: they are pinned anyway)."""
        old = self.smoothed_costs or {}
        out = {}
        for key, row in costs.items():
            out[key] = {}
            for p, q in row.items():
                prev = old.get(key, {}).get(p)
                if key in skipped or not math.isfinite(q):
                    out[key][p] = prev if prev is not None else 0.0
                elif prev is None:
                    out[key][p] = float(q)
                else:
                    out[key][p] = COST_EMA * float(q) + (1 - COST_EMA) * prev
        self.smoothed_costs = out
        return out

    def _report_background_error(self) -> None:
        p = self.pending
        if p is not None and p.error and not p.reported:
            self.log(f"background planning after step {p.measure_step} failed: {p.error}; "
                     "training continues with the current plan")
            p.reported = True

    # -- apply (one broadcast) --------------------------------------------------------------------
    def _apply_pending(self, step: int) -> None:
        pending, self.pending = self.pending, None
        new_plan, info = None, {}
        if self.rank == 0:
            new_plan, info = self._collect(pending)
        new_plan = self._broadcast_plan(new_plan)
        previous = self.plan
        if new_plan is None or not self._switch_to(new_plan, step, info):
            return
        if self.config.loss_guard_factor and new_plan != previous:
            self._guard = {"previous": previous, "before": list(self._recent_losses), "after": [],
                           "check_step": step + self.config.loss_guard_window - 1, "applied": step}

    def _collect(self, pending: _Pending) -> tuple[Plan | None, dict]:
        """Rank 0: wait for the solver (up to its time limit) and take its plan, or keep the old one."""
        limit = self.config.solver_time_limit_s
        if pending.thread is not None:
            pending.thread.join(timeout=max(0.0, pending.started + limit - time.perf_counter()))
            if pending.thread.is_alive():
                self.log(f"solver for step {pending.measure_step} still running after {limit:.0f} s; "
                         "keeping the previous plan")
                return None, {}
        if pending.error is not None:
            self._report_background_error()
            return None, {}
        out = pending.result
        out["measure_step"] = pending.measure_step
        return out["plan"], out

    def _broadcast_plan(self, plan: Plan | None) -> Plan | None:
        """Every rank gets rank 0's plan (ids over all global layers; -1 = keep the current plan)."""
        n = self.inventory
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return plan
        ids = torch.tensor(plan.to_ids(n) if plan is not None else [-1] * len(self.keys),
                           dtype=torch.int64, device=collective_device())
        dist.broadcast(ids, src=0)
        if int(ids[0]) < 0:
            return None
        return Plan.from_ids(ids.tolist(), n)

    def _switch_to(self, plan: Plan, step: int, info: dict) -> bool:
        """Apply `plan` on every rank, or on none: a rank whose apply raised makes every rank keep
        (or go back to) the previous plan. Returns whether the plan was taken."""
        previous, error = self.plan, None
        try:
            self._apply(self.ctx, plan)
        except Exception as exc:  # noqa: BLE001 - a failed re-plan never stops training
            error = f"{type(exc).__name__}: {exc}"
        if self._any_rank(error is not None, f"applying the plan at step {step}", error):
            if error is None:
                self._apply(self.ctx, previous)
            return False
        self.plan = plan
        self._record(step, plan, previous, info)
        return True

    # -- loss guard -----------------------------------------------------------------------------
    def _close_guard(self, step: int) -> None:
        guard, self._guard = self._guard, None
        revert = False
        before, after = guard["before"], guard["after"]
        if before and after:
            revert = (sum(after) / len(after)) > self.config.loss_guard_factor * (sum(before) / len(before))
        revert = self._agree(revert)
        if revert:
            self.log(f"loss guard: mean loss over the {len(after)} steps after the plan of step "
                     f"{guard['applied']} exceeds {self.config.loss_guard_factor}x the mean before; "
                     "reverting to the previous plan")
            self._switch_to(guard["previous"], step + 1, {"event": "loss_guard_revert"})

    def _agree(self, flag: bool) -> bool:
        """The last rank holds the loss (last pipeline stage): its decision, for every rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=collective_device())
        dist.broadcast(t, src=dist.get_world_size() - 1)
        return bool(int(t[0]))

    def _record(self, step: int, plan: Plan, previous: Plan | None, info: dict) -> None:
        self.history.append({"step": step, "plan": {str(k): p.value for k, p in plan.items()},
                             "event": info.get("event", "update")})
        row = self.plan_log.record(step, plan, previous, info) if self.rank == 0 else None
        self.plan_log.publish(row, self.history)  # every rank: the run's loggers may live on another one

    # -- checkpoint state (JSON-safe) -----------------------------------------------------------
    def state_dict(self) -> dict:
        pending = None
        if self.pending is not None:
            solved = None
            if self.rank == 0:  # wait, so a resumed run applies the very same plan
                plan, _ = self._collect(self.pending)
                solved = plan.to_dict() if plan is not None else None
            pending = {"measure_step": self.pending.measure_step, "apply_step": self.pending.apply_step,
                       "plan": solved}
        return {
            "version": STATE_VERSION,
            "plan": self.plan.to_dict(),
            "history": self.history,
            "smoothed_costs": None if self.smoothed_costs is None else
            {str(k): {p.value: q for p, q in row.items()} for k, row in self.smoothed_costs.items()},
            "next_measure": self.next_measure,
            "pending": pending,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from `state_dict()`; a state that does not fit this model is refused whole.
        A pinned plan (`pin_plan`) stays: it beats the checkpoint's."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"SNIP controller state: unknown or missing version (expected {STATE_VERSION})")
        plan = Plan.from_dict(state["plan"]).check_model(self.inventory)
        smoothed = state.get("smoothed_costs")
        if smoothed is not None:
            smoothed = {parse_key(k): {Precision.parse(p): float(q) for p, q in row.items()}
                        for k, row in smoothed.items()}
            Plan({k: Precision.BF16 for k in smoothed}).check_model(self.inventory)
        pending = state.get("pending")
        pending_plan = None
        if pending is not None and pending.get("plan") is not None:
            pending_plan = Plan.from_dict(pending["plan"]).check_model(self.inventory)
        # Validated: now commit (a plan of another layout keeps out what this one cannot run).
        if not self.config.pin_plan:
            self.plan, self.plan_source = self._runnable(plan), "checkpoint"
        self.history = list(state.get("history", []))
        self.smoothed_costs = smoothed
        self.next_measure = state.get("next_measure")
        self.pending = None
        if pending is not None:
            self.pending = _Pending(measure_step=int(pending["measure_step"]),
                                    apply_step=int(pending["apply_step"]), started=time.perf_counter())
            if pending_plan is not None:
                self.pending.result = {"plan": pending_plan, "result": None, "costs": None}
            elif self.rank == 0:
                self.pending.error = "the solve was not finished when the checkpoint was written"
        if self.ctx is not None:
            self._apply(self.ctx, self.plan)
