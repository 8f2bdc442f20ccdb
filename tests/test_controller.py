"""SnipController in one process with injected measurement/estimate/solver: schedule, policies,
reporting and checkpoint state. Multi-rank behaviour is in tests/test_controller_distributed.py."""

import json
import math
import time
from types import SimpleNamespace

import pytest

from snip_megatron.config import SnipConfig
from snip_megatron.controller import Schedule, SnipController
from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.loggers import RunLoggers
from snip_megatron.plan import Plan, all_keys
from snip_megatron.shapes import ModelShape

SHAPE = ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, vocab_size=256, seq_length=32)
KEYS = all_keys(SHAPE.num_layers)


def fake_costs(step_seed=0, nan_layer=None):
    """Costs that make layer 1 and the fc2 linears expensive in FP4."""
    costs, ldiv, wdiv = {}, {}, {}
    for i, k in enumerate(KEYS):
        hard = k.layer == 1 or k.name == "linear_fc2"
        q4 = (10.0 if hard else 1.0) + 0.01 * i + step_seed
        costs[k] = {Precision.BF16: 0.0, Precision.FP8: 0.1, Precision.FP4: q4}
        ldiv[k] = dict(costs[k])
        wdiv[k] = {p: 0.0 for p in costs[k]}
    nonfinite = {}
    if nan_layer is not None:
        costs[nan_layer] = {p: math.nan for p in costs[nan_layer]}
        nonfinite[nan_layer] = ["x_sq"]
    return SimpleNamespace(costs=costs, loss_div=ldiv, weight_div=wdiv, nonfinite=nonfinite)


class Harness:
    def __init__(self, tmp_path=None, solve=None, estimate=None, **cfg):
        base = dict(enabled=True, fp4_budget=0.5, interval=10, lag=2, warmup=5, solver_time_limit_s=5.0)
        base.update(cfg)
        self.config = SnipConfig(**base)
        self.applied = []
        self.measured = []
        self.logs = []
        kwargs = {}
        if solve is not None:
            kwargs["solve"] = solve
        self.ctrl = SnipController(self.config, SHAPE, total_steps=100, run_dir=tmp_path,
                                   log=self.logs.append, measure=self._measure,
                                   estimate=estimate or (lambda stats: fake_costs()),
                                   apply=lambda ctx, plan: self.applied.append(plan), **kwargs)
        self.ctrl.attach(SimpleNamespace(step=0))

    def _measure(self, trainer, step):
        self.measured.append(step)
        return "stats"

    def run(self, start, stop, losses=None):
        for step in range(start, stop):
            self.ctrl.on_step_start(None, step)
            self.ctrl.on_step_end(None, step, {"loss": (losses or {}).get(step, 3.0)})


def test_schedule():
    s = Schedule(first=5, interval=10, lag=2)
    assert [t for t in range(40) if s.is_measure_step(t)] == [5, 15, 25, 35]
    assert s.next_measure_step(0) == 5 and s.next_measure_step(6) == 15 and s.next_measure_step(15) == 15
    assert SnipConfig(enabled=True, warmup=0.2, interval=10, lag=1).warmup_steps(1000) == 200


def test_measures_applies_after_lag_and_meets_budget(tmp_path):
    h = Harness(tmp_path)
    assert h.applied == [Plan.uniform(4, "fp8")]          # initial plan at attach
    h.run(0, 7)
    assert h.measured == [5]
    assert len(h.applied) == 1                            # not before step 5 + lag
    h.run(7, 8)
    assert len(h.applied) == 2
    plan = h.ctrl.plan
    assert plan.fp4_fraction(h.ctrl.flops) >= 0.5 - 1e-9
    # the expensive layers stay FP8
    assert all(plan[k] is Precision.FP8 for k in KEYS if k.layer == 1)
    h.run(8, 26)
    assert h.measured == [5, 15, 25]
    rows = [json.loads(line) for line in (tmp_path / "snip_plans.jsonl").read_text().splitlines()]
    assert rows[0]["event"] == "initial" and rows[1]["step"] == 7 and rows[1]["solver"] in ("cbc", "exact")
    assert {"layer", "precision", "previous", "Q.fp4", "dL.fp4", "WD.fp4"} <= set(rows[1]["table"][0])
    assert any("FP4" in line for line in h.logs)


def test_lag_zero_applies_before_the_measured_step_trains():
    h = Harness(lag=0)
    h.run(0, 5)
    assert len(h.applied) == 1
    h.ctrl.on_step_start(None, 5)
    assert len(h.applied) == 2


def test_nonfinite_statistics_keep_that_layers_precision():
    bad = KEYS[5]  # layer 2 fc1: cheap, so FP4 would be chosen for it otherwise
    h = Harness(estimate=lambda stats: fake_costs(nan_layer=bad))
    h.run(0, 8)
    assert h.ctrl.plan[bad] is Precision.FP8
    assert any("non-finite" in line and str(bad) in line for line in h.logs)


def test_solver_exception_keeps_previous_plan_and_is_reported():
    def broken(*a, **k):
        raise RuntimeError("solver exploded")
    h = Harness(solve=broken)
    h.run(0, 12)
    assert h.ctrl.plan == Plan.uniform(4, "fp8")
    assert any("solver exploded" in line for line in h.logs)


def test_hanging_solver_times_out_and_training_goes_on():
    def hang(*a, **k):
        time.sleep(30)
    h = Harness(solve=hang, solver_time_limit_s=0.5)
    start = time.perf_counter()
    h.run(0, 12)
    assert time.perf_counter() - start < 5
    assert h.ctrl.plan == Plan.uniform(4, "fp8")
    assert any("still running" in line for line in h.logs)


def test_loss_guard_reverts_a_plan_after_which_loss_rises():
    h = Harness(loss_guard_factor=1.5, loss_guard_window=3)
    losses = {s: (10.0 if s >= 7 else 3.0) for s in range(20)}
    h.run(0, 8, losses)
    assert h.ctrl.plan != Plan.uniform(4, "fp8")
    h.run(8, 11, losses)
    assert h.ctrl.plan == Plan.uniform(4, "fp8")
    assert any("loss guard" in line for line in h.logs)


def test_baseline_replaces_the_solver():
    h = Harness(baseline="last_fraction", baseline_fraction=0.25)
    h.run(0, 8)
    assert h.measured == []                     # a fixed rule needs no statistics
    plan = h.ctrl.plan
    assert all(plan[k] is Precision.FP8 for k in KEYS if k.layer == 4)
    assert plan.fp4_fraction(h.ctrl.flops) >= 0.5 - 1e-9


def test_relaxed_baseline_meets_a_budget_its_rule_cannot():
    # last_fraction keeps layer 4 (25% of the FLOPs) high: 0.9 is out of reach unless relaxed.
    strict = Harness(baseline="last_fraction", fp4_budget=0.9)
    strict.run(0, 8)
    assert strict.ctrl.plan == Plan.uniform(4, "fp8") and any("infeasible" in line for line in strict.logs)
    relaxed = Harness(baseline="last_fraction", fp4_budget=0.9, baseline_relax=True)
    relaxed.run(0, 8)
    assert relaxed.ctrl.plan.fp4_fraction(relaxed.ctrl.flops) >= 0.9 - 1e-9
    assert relaxed.ctrl.plan[(4, "linear_fc2")] is Precision.FP8  # the rule's last linear gives in last


def test_a_loop_in_other_formats_is_refused():
    def loop(fp4_recipe):
        applied = []
        return SimpleNamespace(formats=Formats(fp4_recipe=fp4_recipe), set_plan=applied.append,
                               chunks=["chunk"], step=0, applied=applied)

    ctrl = SnipController(SnipConfig(enabled=True, fp4_recipe="mxfp4"), SHAPE, total_steps=100,
                          log=lambda m: None)
    with pytest.raises(ValueError, match=r"SNIP measures fp8=blockwise fp4=mxfp4 but the training loop's "
                                         r"planned linears run fp8=blockwise fp4=nvfp4"):
        ctrl.on_train_start(loop("nvfp4"))
    same = loop("mxfp4")
    ctrl.on_train_start(same)
    assert same.applied == [Plan.uniform(4, "fp8")]  # the plan goes through the loop's set_plan


def test_disabled_and_pinned_never_measure(tmp_path):
    off = Harness(enabled=False)
    off.run(0, 30)
    assert off.measured == [] and off.applied == [Plan.uniform(4, "bf16")]
    saved = Plan({**{k: "fp4" for k in KEYS}, "1.linear_qkv": "fp8"}).save(tmp_path / "plan.json")
    pinned = Harness(plan=str(saved), pin_plan=True)
    pinned.run(0, 30)
    assert pinned.measured == [] and pinned.ctrl.plan["1.linear_qkv"] is Precision.FP8


def test_state_round_trip_resumes_identically(tmp_path):
    full = Harness()
    full.run(0, 40)
    first = Harness()
    first.run(0, 16)                                   # measured at 15, apply pending at 17
    state = json.loads(json.dumps(first.ctrl.state_dict()))
    resumed = Harness()
    resumed.ctrl.load_state_dict(state)
    assert resumed.ctrl.next_measure == 25 and resumed.ctrl.pending.apply_step == 17
    resumed.run(16, 40)
    assert resumed.ctrl.plan == full.ctrl.plan
    assert [h["step"] for h in resumed.ctrl.history] == [h["step"] for h in full.ctrl.history]


def test_state_for_another_model_is_refused_whole():
    h = Harness()
    h.run(0, 8)
    state = h.ctrl.state_dict()
    other = SnipController(h.config, SHAPE.with_(num_layers=2), total_steps=100, log=lambda m: None,
                           measure=lambda *a: None, apply=lambda *a: None)
    before = other.plan
    with pytest.raises(ValueError, match="layer"):
        other.load_state_dict(state)
    assert other.plan == before
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict({"plan": {}})


def test_a_state_saved_before_the_inventory_resumes_identically():
    """tests/fixtures/v1/snip_state.json: a run of this harness to step 16, saved by the release
    before the inventory (plan format v1)."""
    from pathlib import Path

    state = json.loads((Path(__file__).parent / "fixtures" / "v1" / "snip_state.json").read_text())
    full = Harness()
    full.run(0, 40)
    resumed = Harness()
    resumed.ctrl.load_state_dict(state["controller"])
    assert resumed.ctrl.pending.apply_step == 17
    resumed.run(16, 40)
    assert resumed.ctrl.plan == full.ctrl.plan
    assert [h["step"] for h in resumed.ctrl.history] == [h["step"] for h in full.ctrl.history]


class FailingHarness(Harness):
    """A Harness whose measurements raise `errors` in turn (None: that one works)."""

    def __init__(self, errors, **cfg):
        self.errors = list(errors)
        self.scalars = []
        super().__init__(**cfg)
        writer = SimpleNamespace(scalars=lambda step, v: self.scalars.append((step, v)), flush=lambda: None)
        # the run's TensorBoard, for the failures alone (the plan's figures would draw images)
        self.ctrl.failures.loggers = RunLoggers(writers=lambda: [writer], enabled=True)

    def _measure(self, trainer, step):
        self.measured.append(step)
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        return "stats"


def test_a_failed_measurement_is_a_warning_a_count_and_twice_the_same_stops_replanning(caplog):
    h = FailingHarness([RuntimeError("stats exploded\n  at line 2"), RuntimeError("stats exploded\n  at line 9")])
    with caplog.at_level("WARNING", logger="snip_megatron.measure"):
        h.run(0, 36)
    assert [r.getMessage() for r in caplog.records if r.name == "snip_megatron.measure"] == [
        "[snip] rank 0: measurement at step 5 failed: RuntimeError: stats exploded",
        "[snip] rank 0: measurement at step 15 failed: RuntimeError: stats exploded"]
    assert h.scalars == [(5, {"snip/measure_failures": 1.0}), (15, {"snip/measure_failures": 2.0})]
    assert h.measured == [5, 15]  # no measurement after the stop...
    assert h.ctrl.plan == Plan.uniform(4, "fp8") and h.applied == [h.ctrl.plan]  # ...and the plan kept
    stops = [line for line in h.logs if "stops re-planning" in line]
    assert stops == ["[snip] the measurement failed at two measurements in a row the same way (RuntimeError: "
                     "stats exploded), at step 15: SNIP stops re-planning and the run goes on with its current "
                     "plan; fix the cause and resume to re-plan again, or turn strict mode on (--snip-strict, "
                     "Bridge's snip.strict) to stop the run at a failed measurement"]
    assert sum("skipping this update" in line for line in h.logs) == 1
    assert h.ctrl.state_dict()["next_measure"] == 45  # a resumed run measures again


def test_other_failures_in_a_row_skip_their_updates_and_replanning_goes_on():
    h = FailingHarness([RuntimeError("one"), ValueError("two"), None])
    h.run(0, 28)
    assert h.measured == [5, 15, 25] and h.ctrl.failures.count == 2 and h.ctrl.failures.stopped is None
    assert [e["step"] for e in h.ctrl.history] == [0, 27]  # the third measurement's plan, applied after the lag


def test_strict_mode_stops_the_run_at_the_first_failed_measurement():
    from snip_megatron.megatron.args import add_snip_args, snip_config_from_args

    args = add_snip_args(__import__("argparse").ArgumentParser()).parse_args(["--snip", "--snip-strict"])
    assert snip_config_from_args(args).strict
    h = FailingHarness([KeyError("x_sq")], strict=True)
    with pytest.raises(RuntimeError, match=r"^SNIP: the measurement at step 5 failed \(KeyError: 'x_sq'\) and strict "
                                           r"mode is on \(--snip-strict, Bridge's snip.strict\): stopping the run"):
        h.run(0, 8)
