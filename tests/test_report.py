"""The run report: heat map and loss curve from a run directory."""

import json

import pytest

from snip_megatron.plan import Plan
from snip_megatron.report import load_plan_history, main, make_report


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
