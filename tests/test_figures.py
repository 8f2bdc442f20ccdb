"""SNIP's figures of each plan in the run's loggers: scalars, heat map and table, from PlanLog's row."""

from types import SimpleNamespace

import numpy as np
import pytest

from snip_megatron.figures import HEATMAP_TAG, TABLE_TAG, PlanFigures, plan_scalars, plan_table
from snip_megatron.formats.precision import Precision
from snip_megatron.loggers import RunLoggers, WandbWriter
from snip_megatron.plan import Plan, all_keys
from snip_megatron.report import PlanLog
from tests.test_loggers import FakeWandb


def measured_case():
    """One layer: a previous all-BF16 plan, a measured plan with costs, the solver's answer."""
    qkv, proj, fc1, fc2 = keys = all_keys(1)
    flops = {qkv: 1.0, proj: 2.0, fc1: 3.0, fc2: 4.0}
    plan = Plan({qkv: "bf16", proj: "fp8", fc1: "fp4", fc2: "fp8"})  # FP4 30%, FP8 60%, BF16 10%
    q = {k: {Precision.FP8: 0.1 * (i + 1), Precision.FP4: 1.0 * (i + 1)} for i, k in enumerate(keys)}
    dl = {k: {p: v / 2 for p, v in row.items()} for k, row in q.items()}
    costs = SimpleNamespace(costs=q, loss_div=dl, weight_div=dl)
    result = SimpleNamespace(solver="cbc", status="optimal", objective=3.6, fallback_reason=None)
    info = {"result": result, "costs": costs, "solve_s": 0.25, "measure_s": 1.5}
    return flops, plan, Plan.uniform(1, "bf16"), info


def test_a_measured_plan_gives_every_figure():
    flops, plan, previous, info = measured_case()
    run = FakeWandb()
    log = PlanLog(None, flops, log=lambda _: None, loggers=RunLoggers(lambda: [WandbWriter(run)], enabled=True))
    log.publish(log.record(0, previous, None, {"event": "initial"}))
    log.publish(log.record(5, plan, previous, info))
    assert [step for step, _ in run.logged] == [0, 0, 0, 5, 5, 5]
    scalars = run.logged[3][1]
    assert scalars == pytest.approx({
        "snip/flops_fp4": 0.3, "snip/flops_fp8": 0.6, "snip/flops_bf16": 0.1,
        "snip/modelled_speedup": 10 / 4.75, "snip/linears_changed": 3.0, "snip/measure_s": 1.5,
        "snip/solve_s": 0.25,
        "snip/predicted_cost": 0.2 + 3.0 + 0.4,  # proj fp8, fc1 fp4, fc2 fp8; qkv BF16 costs 0
        "snip/predicted_loss_increase": (0.2 + 3.0 + 0.4) / 2})
    assert set(run.logged[0][1]) == {"snip/flops_fp4", "snip/flops_fp8", "snip/flops_bf16",
                                     "snip/modelled_speedup", "snip/linears_changed"}  # nothing measured yet
    image = run.logged[4][1][HEATMAP_TAG].data
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and image.shape[0] > 100
    table = run.logged[5][1][TABLE_TAG]
    assert table.columns == ["layer", "linear", "precision", "previous", "Q.fp8", "Q.fp4", "dL.fp8", "dL.fp4",
                             "WD.fp8", "WD.fp4"]
    assert table.data[2] == [1, "linear_fc1", "fp4", "bf16", pytest.approx(0.3), 3.0, pytest.approx(0.15),
                             1.5, pytest.approx(0.15), 1.5]
    initial = run.logged[2][1][TABLE_TAG]
    assert initial.columns == ["layer", "linear", "precision"] and initial.data[0] == [1, "linear_qkv", "bf16"]


def test_no_logger_no_work_and_a_broken_one_never_stops_training(capsys):
    flops, plan, previous, info = measured_case()
    asked = []
    quiet = PlanLog(None, flops, log=lambda _: None, loggers=RunLoggers(lambda: asked.append(1) or [], enabled=False))
    quiet.publish(quiet.record(5, plan, previous, info))
    assert asked == []

    class Broken:
        def scalars(self, step, values):
            raise OSError("disk full")

    log = PlanLog(None, flops, log=lambda _: None, loggers=RunLoggers(lambda: [Broken()], enabled=True))
    log.publish(log.record(5, plan, previous, info))
    assert "plan of step 5 to the run's loggers failed: OSError: disk full" in capsys.readouterr().out


def test_scalars_and_table_of_a_row_without_costs():
    row = {"step": 1, "plan": {"1.linear_qkv": "fp8"}, "fp4_fraction": 0.0, "fp8_fraction": 1.0,
           "speedup": 2.0, "measure_s": float("nan")}
    assert plan_scalars(row) == {"snip/flops_fp4": 0.0, "snip/flops_fp8": 1.0, "snip/flops_bf16": 0.0,
                                 "snip/modelled_speedup": 2.0, "snip/linears_changed": 0.0}
    assert plan_table(row) == (["layer", "linear", "precision"], [[1, "linear_qkv", "fp8"]])


def test_the_heat_map_shows_the_plans_so_far(monkeypatch):
    """The controller's history (restored with a checkpoint) is the heat map's columns."""
    import snip_megatron.figures as figures

    drawn = []
    monkeypatch.setattr(figures, "heatmap_image", lambda history: drawn.append(history) or np.zeros((2, 2, 3)))

    def row(step, precision):  # as PlanLog and the controller write a plan
        return {"step": step, "plan": {str(k): p.value for k, p in Plan.uniform(1, precision).items()},
                "fp4_fraction": 0.0, "fp8_fraction": 1.0, "speedup": 2.0}

    publish = PlanFigures(RunLoggers(lambda: [WandbWriter(FakeWandb())], enabled=True)).publish
    publish(row(4, "fp4"), [row(0, "fp8"), row(4, "fp4")])
    publish(row(5, "fp8"))  # no history given: this plan alone
    assert [[(s, p.counts()["fp4"]) for s, p in h] for h in drawn] == [[(0, 0), (4, 4)], [(5, 0)]]
