"""The SNIP controller: measure, estimate, solve and apply precision plans during training.

The loop of DESIGN section 6, as a step hook (`on_step_start`, `on_step_end`, `state_dict`,
`load_state_dict`) that the compact trainer and the Megatron-LM entry point both call:

- step < first measurement: the initial plan (every planned linear in `initial_precision`, or a
  saved plan);
- measurement step t (before the optimizer step of t, on t's batch, on every rank): statistics
  and the two noise passes, reduced to global rank 0;
- rank 0 estimates costs and solves the ILP in a background thread while training goes on;
- apply step t + lag (at the start of that step): every rank joins one broadcast of the plan
  from rank 0 (rank 0 waits for the solver if needed, up to its time limit) and applies its slice.
  With lag 0 the plan is applied right after the measurement, before step t trains.

Steps that neither measure, apply nor close a loss-guard window issue no collective.
Failures never stop training: a layer with non-finite statistics keeps its precision; a solver
that raises, hangs past its limit or finds nothing keeps the previous plan; an error in the
background thread is reported on the next step; the optional loss guard reverts a plan after
which the loss rose by more than `loss_guard_factor`.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from snip_megatron.config import SnipConfig
from snip_megatron.formats.precision import Precision
from snip_megatron.plan import LayerKey, Plan, all_keys, parse_key
from snip_megatron.shapes import ModelShape

PLANS_FILE = "snip_plans.jsonl"
COST_EMA = 0.5
"""Weight of a new measurement in the smoothed cost table (the rest is the previous smoothed
value): one-batch statistics are noisy, and plans should not flap on that noise."""


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


class SnipController:
    """Re-plans the precision of every planned linear during training (see module docstring).

    `measure(trainer, step) -> StatsTable | None` runs the statistics step and the two noise passes
    on every rank and returns the reduced table on global rank 0 (None elsewhere). `estimate` maps a
    table to a cost table, `solve` a cost table to a PlanResult, `apply(model_chunks, plan)` applies
    this rank's slice of a plan. The defaults are SNIP's own; tests inject fakes.
    """

    name = "snip"
    """Key of the controller's state in the trainer's checkpoints (train.hooks.StepHook)."""

    def __init__(self, config: SnipConfig, shape: ModelShape, *, total_steps: int,
                 run_dir: str | Path | None = None, tokens_per_step: int | None = None,
                 stages: Mapping[LayerKey, int] | None = None, log: Callable[[str], None] = print,
                 measure: Callable | None = None, estimate: Callable | None = None,
                 solve: Callable | None = None, apply: Callable | None = None):
        from snip_megatron.planner.flops import flop_table

        self.config = config
        self.shape = shape
        self.keys = all_keys(shape.num_layers)
        self.flops = flop_table(shape, tokens_per_step)
        self.stages = dict(stages) if stages else None
        self.run_dir = Path(run_dir) if run_dir else None
        self._log = log
        self._measure = measure or _default_measure(config)
        self._estimate = estimate or _default_estimate(config)
        self._solve = solve or _default_solve(config)
        self._apply_is_default = apply is None
        self._apply = apply or functools.partial(_default_apply, fp8_recipe=config.fp8_recipe,
                                                 fp4_recipe=config.fp4_recipe)
        self.schedule = Schedule(first=config.warmup_steps(total_steps), interval=config.interval,
                                 lag=config.lag)
        self.plan = self._initial_plan()
        self.history: list[dict] = []
        self.smoothed_costs: dict[LayerKey, dict[Precision, float]] | None = None
        self.next_measure = self.schedule.first if config.measures or config.baseline else None
        self.pending: _Pending | None = None
        self.model_chunks: list = []
        self._guard: dict | None = None
        self._recent_losses: list[float] = []

    # -- set-up ---------------------------------------------------------------------------------
    def _initial_plan(self) -> Plan:
        if not self.config.enabled:
            return Plan.uniform(self.shape.num_layers, Precision.BF16)
        if self.config.plan:
            return Plan.load(self.config.plan).check_model(self.shape.num_layers)
        return Plan.uniform(self.shape.num_layers, self.config.initial_precision)

    def attach(self, model_chunks: list, step: int = 0) -> None:
        """Take the model chunks of this rank and apply the current plan to them."""
        self.model_chunks = list(model_chunks)
        self._apply(self.model_chunks, self.plan)
        if step == 0 and not self.history:
            self._record(step, self.plan, previous=None, info={"event": "initial"})

    def on_train_start(self, trainer) -> None:
        """Trainer hook: after set-up and any resume, apply the plan to the trainer's chunks.
        Plans then go through `trainer.set_plan`, so the trainer's checkpoints name the live plan."""
        if self._apply_is_default and hasattr(trainer, "set_plan"):
            self._check_formats(getattr(trainer, "config", None))
            self._apply = lambda chunks, plan: trainer.set_plan(plan)
        self.attach(trainer.chunks, step=trainer.step)

    def _check_formats(self, train_config) -> None:
        """The trainer must run the formats SNIP measures, or its plans would mean other formats."""
        for name in ("fp8_recipe", "fp4_recipe"):
            theirs = getattr(train_config, name, None)
            ours = getattr(self.config, name)
            if theirs is not None and theirs != ours:
                raise ValueError(f"SnipConfig.{name}={ours!r} but the trainer runs {name}={theirs!r}: "
                                 f"set TrainConfig.{name}={ours!r} (or SnipConfig.{name}={theirs!r})")

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def log(self, msg: str) -> None:
        if self.rank == 0:
            self._log(f"[snip] {msg}")

    # -- step hooks -----------------------------------------------------------------------------
    def on_step_start(self, trainer, step: int) -> None:
        self._report_background_error()
        if self.pending is not None and step >= self.pending.apply_step:
            self._apply_pending(step)
        if self.next_measure is not None and step == self.next_measure:
            self._start_measurement(trainer, step)
            self.next_measure = step + self.schedule.interval
            if self.pending is not None and self.pending.apply_step <= step:
                self._apply_pending(step)  # lag 0: the new plan trains this very step

    def on_step_end(self, trainer, step: int, metrics: Mapping | None = None) -> None:
        loss = (metrics or {}).get("loss")
        if loss is not None and math.isfinite(float(loss)):
            self._recent_losses = (self._recent_losses + [float(loss)])[-self.config.loss_guard_window:]
        if self._guard is not None:
            if loss is not None:
                self._guard["after"].append(float(loss))
            if step >= self._guard["check_step"]:
                self._close_guard(step)

    # -- measurement and background solve ---------------------------------------------------------
    def _start_measurement(self, trainer, step: int) -> None:
        start = time.perf_counter()
        stats = None
        if self.config.measures or self.config.baseline == "min_rel_error":
            stats = self._measure(trainer, step)
        measure_s = time.perf_counter() - start
        pending = _Pending(measure_step=step, apply_step=step + self.schedule.lag, started=time.perf_counter())
        if self.rank == 0:
            previous = self.plan
            pending.thread = threading.Thread(target=self._plan_in_background,
                                              args=(pending, stats, previous, measure_s),
                                              name="snip-solver", daemon=True)
            pending.thread.start()
        self.pending = pending

    def _plan_in_background(self, pending: _Pending, stats, previous: Plan, measure_s: float) -> None:
        try:
            pending.result = self._plan_from(stats, previous, measure_s)
        except Exception as exc:  # reported on the next step; training goes on with the old plan
            pending.error = f"{type(exc).__name__}: {exc}"

    def _plan_from(self, stats, previous: Plan, measure_s: float) -> dict:
        start = time.perf_counter()
        cfg = self.config
        if cfg.baseline is not None:
            from snip_megatron.planner.baselines import baseline_plan

            rel_error = None
            if stats is not None:
                from snip_megatron.estimate.cost import proxy_table

                rel_error = proxy_table(stats)
            result = baseline_plan(cfg.baseline, self.keys, self.flops, cfg.fp4_budget,
                                   rel_error=rel_error, seed=cfg.seed, k=cfg.baseline_k,
                                   fraction=cfg.baseline_fraction, stages=self.stages,
                                   relax=cfg.baseline_relax)
            return {"plan": result.plan, "result": result, "costs": None, "measure_s": measure_s,
                    "solve_s": time.perf_counter() - start, "skipped": {}}
        costs = self._estimate(stats)
        skipped = dict(getattr(costs, "nonfinite", {}) or {})
        table = self._smooth(costs.costs, skipped)
        pinned = {k: previous[k] for k in skipped}
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
        if new_plan is None:
            return
        self._switch_to(new_plan, step, info)
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
        n = self.shape.num_layers
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return plan
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        ids = torch.tensor(plan.to_ids(n) if plan is not None else [-1] * len(self.keys),
                           dtype=torch.int64, device=device)
        dist.broadcast(ids, src=0)
        if int(ids[0]) < 0:
            return None
        return Plan.from_ids(ids.tolist(), n)

    def _switch_to(self, plan: Plan, step: int, info: dict) -> None:
        previous = self.plan
        self._apply(self.model_chunks, plan)
        self.plan = plan
        self._record(step, plan, previous, info)

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
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
        dist.broadcast(t, src=dist.get_world_size() - 1)
        return bool(int(t[0]))

    # -- reporting ------------------------------------------------------------------------------
    def _record(self, step: int, plan: Plan, previous: Plan | None, info: dict) -> None:
        from snip_megatron.planner.config import DEFAULT_GEMM_COST
        from snip_megatron.planner.problem import measure

        achieved = measure(plan, self.flops, DEFAULT_GEMM_COST)  # the planner's own models
        fp4 = achieved.fp4_fraction
        row = {"step": step, "plan": {str(k): p.value for k, p in plan.items()},
               "digest": plan.digest(), "fp4_fraction": fp4, "speedup": achieved.speedup}
        result = info.get("result")
        if result is not None:
            row.update(solver=result.solver, status=result.status, objective=result.objective,
                       solve_s=info.get("solve_s"), measure_s=info.get("measure_s"),
                       measure_step=info.get("measure_step"), fallback=result.fallback_reason)
        if info.get("skipped"):
            row["nonfinite_layers"] = {str(k): list(v) for k, v in info["skipped"].items()}
        if info.get("event"):
            row["event"] = info["event"]
        self.history.append({"step": step, "plan": row["plan"], "event": info.get("event", "update")})
        if self.rank != 0:
            return
        changed = previous.diff(plan) if previous is not None else []
        self.log(f"step {step}: plan {plan.digest()[:12]}  FP4 {fp4:.1%} of linear FLOPs, "
                 f"modelled GEMM speed-up {row['speedup']:.2f}x, {len(changed)} linears changed"
                 + (f", solver {result.solver} ({result.status}) {info.get('solve_s', 0):.2f} s, "
                    f"measurement {info.get('measure_s', 0):.2f} s" if result is not None else ""))
        for key, fields in (info.get("skipped") or {}).items():
            self.log(f"  {key}: non-finite statistics ({', '.join(fields)}); kept {plan[key]}")
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
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / PLANS_FILE, "a") as f:
                f.write(json.dumps(row, default=_json_default) + "\n")
        _tensorboard(self.run_dir, step, fp4, row["speedup"])

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
            "version": 1,
            "plan": self.plan.to_dict(),
            "history": self.history,
            "smoothed_costs": None if self.smoothed_costs is None else
            {str(k): {p.value: q for p, q in row.items()} for k, row in self.smoothed_costs.items()},
            "next_measure": self.next_measure,
            "pending": pending,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from `state_dict()`; a state that does not fit this model is refused whole."""
        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise ValueError("SNIP controller state: unknown or missing version (expected 1)")
        plan = Plan.from_dict(state["plan"]).check_model(self.shape.num_layers)
        smoothed = state.get("smoothed_costs")
        if smoothed is not None:
            smoothed = {parse_key(k): {Precision.parse(p): float(q) for p, q in row.items()}
                        for k, row in smoothed.items()}
            Plan({k: Precision.BF16 for k in smoothed}).check_model(self.shape.num_layers)
        pending = state.get("pending")
        pending_plan = None
        if pending is not None and pending.get("plan") is not None:
            pending_plan = Plan.from_dict(pending["plan"]).check_model(self.shape.num_layers)
        # Validated: now commit.
        self.plan = plan
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
        if self.model_chunks:
            self._apply(self.model_chunks, self.plan)


def format_plan_table(plan: Plan, previous: Plan, costs=None) -> str:
    """The per-update table: layer, precision, previous precision, Q, dL, WD (FP4 and FP8)."""
    head = f"  {'layer':<16}{'now':>6}{'was':>6}"
    if costs is not None:
        head += "".join(f"{'Q.' + p:>11}{'dL.' + p:>11}{'WD.' + p:>11}" for p in ("fp4", "fp8"))
    lines = [head]
    for key in plan:
        mark = " *" if plan[key] != previous[key] else ""
        line = f"  {str(key):<16}{plan[key].value:>6}{previous[key].value:>6}"
        if costs is not None:
            for p in (Precision.FP4, Precision.FP8):
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


_TB_WRITERS: dict = {}


def _tensorboard(run_dir: Path | None, step: int, fp4: float, speedup: float) -> None:
    """Scalars to TensorBoard when it is installed (optional dependency)."""
    if run_dir is None:
        return
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:
        return
    writer = _TB_WRITERS.get(run_dir)
    if writer is None:
        writer = _TB_WRITERS[run_dir] = SummaryWriter(str(run_dir / "tensorboard"))
    writer.add_scalar("snip/fp4_fraction", fp4, step)
    writer.add_scalar("snip/modelled_speedup", speedup, step)
    writer.flush()


# -- defaults: SNIP's own measurement, estimate, solver and apply --------------------------------

def _default_measure(config: SnipConfig):
    def measure(trainer, step):
        from snip_megatron.stats import measure as stats_measure

        return stats_measure(trainer, config=config, step=step)
    return measure


def _default_estimate(config: SnipConfig):
    def estimate(stats):
        from snip_megatron.estimate.config import EstimateConfig
        from snip_megatron.estimate.cost import cost_table

        return cost_table(stats, EstimateConfig(lam=config.lambda_wd))
    return estimate


def _default_solve(config: SnipConfig):
    def solve(costs, flops, *, previous=None, stages=None, pinned=None):
        from snip_megatron.planner.config import PlannerConfig
        from snip_megatron.planner.solve import solve_plan

        planner = PlannerConfig(rho=config.fp4_budget,
                                allowed=tuple(Precision.parse(p) for p in config.precisions),
                                per_stage=config.per_stage_budget,
                                switch_penalty=config.switch_penalty,
                                time_limit_s=config.solver_time_limit_s, gap_rel=config.solver_gap)
        return solve_plan(costs, flops, planner, previous=previous, stages=stages, pinned=pinned)
    return solve


def _default_apply(model_chunks, plan, *, fp8_recipe: str, fp4_recipe: str):
    from snip_megatron.megatron.apply import apply_plan

    return apply_plan(model_chunks, plan, fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe)
