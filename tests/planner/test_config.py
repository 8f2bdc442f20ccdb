import pytest

from snip_megatron.formats.precision import Precision
from snip_megatron.planner.config import PlannerConfig


def test_defaults_follow_the_paper():
    c = PlannerConfig()
    assert c.allowed_precisions() == (Precision.FP8, Precision.FP4)
    assert c.gemm_costs() == {Precision.BF16: 1.0, Precision.FP8: 0.5, Precision.FP4: 0.25}
    assert PlannerConfig(allowed=("BF16", "fp4")).allowed_precisions() == (Precision.BF16, Precision.FP4)


@pytest.mark.parametrize("field,value", [
    ("budget", "flops"), ("rho", 1.5), ("rho", -0.1), ("rho", float("nan")), ("rho", "0.9"), ("speedup", 0.0), ("allowed", ()),
    ("allowed", ("fp8", "fp8")), ("allowed", ("fp6",)), ("switch_penalty", -1.0), ("solver", "gurobi"),
    ("time_limit_s", 0), ("gap_rel", 1.0), ("threads", 0), ("exact_max_states", 4),
    ("aggregate_layers", 1),
    ("gemm_cost", {"bf16": 1.0, "fp8": 0.5}), ("gemm_cost", {"bf16": 1.0, "fp8": 0.5, "fp4": -1}),
])
def test_bad_fields_name_themselves(field, value):
    with pytest.raises(ValueError, match=field if field != "allowed" or value != ("fp6",) else "fp6"):
        PlannerConfig(**{field: value})


def test_rho_defaults_to_the_fraction_budgets_own():
    from dataclasses import replace

    from snip_megatron.planner.config import BUDGETS, DEFAULT_FP4_FRACTION, DEFAULT_FP8_FRACTION

    assert BUDGETS == ("fp4_fraction", "fp8_fraction", "speedup")
    assert (DEFAULT_FP4_FRACTION, DEFAULT_FP8_FRACTION) == (0.75, 0.9)
    assert [PlannerConfig(budget=b).fraction for b in BUDGETS] == [0.75, 0.9, 0.75]
    assert PlannerConfig(budget="fp8_fraction", rho=0.6).fraction == 0.6 and PlannerConfig(rho=0).fraction == 0
    # An unset rho follows the budget, also in a copy; a given one is kept.
    assert replace(PlannerConfig(budget="fp8_fraction"), budget="fp4_fraction").fraction == 0.75
    assert replace(PlannerConfig(budget="fp8_fraction", rho=0.9), budget="fp4_fraction").fraction == 0.9
