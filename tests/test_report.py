"""The run report: heat map and loss curve from a run directory."""

import json

import pytest

from snip_megatron.plan import Plan
from snip_megatron.report import PlanLog, load_plan_history, main, make_report


def _write_run(run, plans, metrics):
    with open(run / "snip_plans.jsonl", "w") as f:
        for step, plan in plans:
            f.write(json.dumps({"step": step, "plan": {str(k): p.value for k, p in plan.items()}}) + "\n")
    with open(run / "metrics.jsonl", "w") as f:
        for m in metrics:
            f.write(json.dumps(m) + "\n")


def test_report_draws_pngs(tmp_path, capsys):
    fp8, fp4 = Plan.uniform(3, "fp8"), Plan.uniform(3, "fp4")
    mixed = Plan({**{k: "fp4" for k in fp4}, "1.linear_qkv": "bf16"})
    _write_run(tmp_path, [(0, fp8), (10, mixed), (20, fp4)],
               [{"step": s, "loss": 5 - 0.1 * s, **({"val_loss": 5.0 - 0.1 * s} if s % 5 == 0 else {})}
                for s in range(30)])
    history = load_plan_history(tmp_path)
    assert [s for s, _ in history] == [0, 10, 20] and history[1][1]["1.linear_qkv"].value == "bf16"
    main([str(tmp_path)])
    printed = capsys.readouterr().out
    for name in ("snip_heatmap.png", "loss.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
        assert name in printed


def test_truncated_last_line_is_tolerated(tmp_path):
    _write_run(tmp_path, [(0, Plan.uniform(1, "fp8"))], [])
    with open(tmp_path / "snip_plans.jsonl", "a") as f:
        f.write('{"step": 5, "pla')
    assert len(load_plan_history(tmp_path)) == 1


def test_missing_run_and_missing_plans_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make_report(tmp_path / "nope")
    with pytest.raises(ValueError, match="snip_plans.jsonl"):
        make_report(tmp_path)


# -- the plan log's console line and JSON: what the run's budget counts ------------------------------

def _plan_log_case():
    from types import SimpleNamespace

    from snip_megatron.plan import all_keys

    qkv, proj, fc1, fc2 = all_keys(1)
    flops = {qkv: 1.0, proj: 2.0, fc1: 3.0, fc2: 4.0}
    plan = Plan({qkv: "bf16", proj: "fp8", fc1: "fp4", fc2: "fp8"})  # FP4 30%, FP8 or lower 90%, 2.11x
    result = SimpleNamespace(solver="cbc", status="optimal", objective=1.0, fallback_reason=None)
    info = {"result": result, "solve_s": 0.25, "measure_s": 1.5}
    return flops, plan, Plan.uniform(1, "bf16"), info


@pytest.mark.parametrize("budget", [None, "fp4_fraction", "speedup"])
def test_plan_log_line_of_the_fp4_and_speedup_budgets_is_unchanged(tmp_path, budget):
    from snip_megatron.report import PlanLog

    flops, plan, previous, info = _plan_log_case()
    lines = []
    log = PlanLog(tmp_path, flops, log=lines.append, **({} if budget is None else {"budget": budget}))
    row = log.record(7, plan, previous, info)
    assert lines[0] == (f"[snip] step 7: plan {plan.digest()[:12]}  FP4 30.0% of linear FLOPs, modelled GEMM "
                        "speed-up 2.11x, 3 linears changed, solver cbc (optimal) 0.25 s, measurement 1.50 s")
    assert row["budget"] == (budget or "fp4_fraction")


def test_plan_log_of_an_fp8_budget_states_its_fraction(tmp_path):
    from snip_megatron.report import PlanLog

    flops, plan, previous, info = _plan_log_case()
    lines = []
    log = PlanLog(tmp_path, flops, log=lines.append, budget="fp8_fraction")
    log.record(7, plan, previous, info)
    assert lines[0] == (f"[snip] step 7: plan {plan.digest()[:12]}  FP8 or lower 90.0% of linear FLOPs (FP4 30.0%), "
                        "modelled GEMM speed-up 2.11x, 3 linears changed, solver cbc (optimal) 0.25 s, "
                        "measurement 1.50 s")
    hopper = Plan({k: ("bf16" if k.name == "linear_qkv" else "fp8") for k in plan})  # no FP4: no FP4 share
    del lines[:]
    log.record(9, hopper, plan, {})
    assert lines[0] == (f"[snip] step 9: plan {hopper.digest()[:12]}  FP8 or lower 90.0% of linear "
                                "FLOPs, modelled GEMM speed-up 1.82x, 1 linears changed")
    assert "FP4" not in lines[0]
    rows = [json.loads(line) for line in (tmp_path / "snip_plans.jsonl").read_text().splitlines()]
    assert [r["budget"] for r in rows] == ["fp8_fraction", "fp8_fraction"]
    speed = []  # a speed-up plan without FP4 (Hopper's BF16/FP8 question) states its FP8 share too
    PlanLog(None, flops, log=speed.append, budget="speedup").record(9, hopper, plan, {})
    assert speed[0] == lines[0]
    assert rows[0]["fp8_fraction"] == pytest.approx(0.9) and rows[0]["fp4_fraction"] == pytest.approx(0.3)
    assert rows[1]["fp8_fraction"] == pytest.approx(0.9) and rows[1]["fp4_fraction"] == 0.0
    assert rows[1]["speedup"] == pytest.approx(10 / 5.5)
    with pytest.raises(ValueError, match="budget='fp8'.*fp8_fraction"):
        PlanLog(None, flops, budget="fp8")


def test_plan_table_shows_the_measured_low_precisions():
    from types import SimpleNamespace

    from snip_megatron.formats.precision import Precision
    from snip_megatron.report import format_plan_table

    _, plan, previous, _ = _plan_log_case()

    def costs(precisions):
        row = lambda: {k: {p: 0.5 for p in precisions} for k in plan}  # noqa: E731
        return SimpleNamespace(costs=row(), loss_div=row(), weight_div=row())

    both = format_plan_table(plan, previous, costs([Precision.BF16, Precision.FP8, Precision.FP4]))
    assert both.splitlines()[0] == ("  layer              now   was      Q.fp4     dL.fp4     WD.fp4      Q.fp8"
                                    "     dL.fp8     WD.fp8")
    assert both.splitlines()[2] == ("  1.linear_proj      fp8  bf16        0.5        0.5        0.5        0.5"
                                    "        0.5        0.5 *")
    hopper = format_plan_table(plan, previous, costs([Precision.BF16, Precision.FP8])).splitlines()
    assert hopper[0] == "  layer              now   was      Q.fp8     dL.fp8     WD.fp8"
    assert hopper[2] == "  1.linear_proj      fp8  bf16        0.5        0.5        0.5 *"


# -- every model shape: the heat map's rows and the plan table list every planned linear ---------------

@pytest.mark.parametrize("name", ["dense", "mla_mtp", "moe_local", "hybrid_moe_mamba_gdn"])
def test_heat_map_and_plan_table_of_every_model_shape(tmp_path, name):
    """Plans keyed by the shape's inventory (expert units, MTP linears, hybrid layers): one heat-map
    row per planned linear in forward order, and a plan table whose columns line up whatever the
    longest key ("1.mtp.linear_kv_down_proj")."""
    import matplotlib.pyplot as plt

    from snip_megatron.figures import plan_table
    from snip_megatron.report import format_plan_table, heatmap_figure
    from tests.test_export_shapes import CASES, logged, striped

    inventory = CASES[name].inventory
    first, final = Plan.uniform(inventory, "fp8"), striped(inventory)
    log = PlanLog(tmp_path, inventory.flop_table(32), log=lambda msg: None)
    log.record(0, first, None, {})
    row = log.record(5, final, first, {})
    fig = heatmap_figure(load_plan_history(tmp_path))
    try:
        assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [str(k) for k in inventory.keys()]
    finally:
        plt.close(fig)
    lines = format_plan_table(final, first).splitlines()
    assert len(lines) == len(inventory) + 1
    assert len({len(line.removesuffix(" *")) for line in lines}) == 1, lines  # one width: the columns line up
    assert [line.split()[:3] for line in lines[1:]] == [[str(k), final[k].value, "fp8"] for k in inventory.keys()]
    assert plan_table(row)[1] == [[k.layer, k.name, final[k].value] for k in inventory.keys()]
    assert "heatmap" in make_report(tmp_path)
