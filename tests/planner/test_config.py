import pytest

from snip_megatron.formats.precision import Precision
from snip_megatron.planner.config import PlannerConfig


def test_defaults_follow_the_paper():
    c = PlannerConfig()
    assert c.allowed_precisions() == (Precision.FP8, Precision.FP4)
    assert c.gemm_costs() == {Precision.BF16: 1.0, Precision.FP8: 0.5, Precision.FP4: 0.25}
    assert PlannerConfig(allowed=("BF16", "fp4")).allowed_precisions() == (Precision.BF16, Precision.FP4)


@pytest.mark.parametrize("field,value", [
    ("budget", "flops"), ("rho", 1.5), ("rho", -0.1), ("speedup", 0.0), ("allowed", ()),
    ("allowed", ("fp8", "fp8")), ("allowed", ("fp6",)), ("switch_penalty", -1.0), ("solver", "gurobi"),
    ("time_limit_s", 0), ("gap_rel", 1.0), ("threads", 0), ("exact_max_states", 4),
    ("aggregate_layers", 1),
    ("gemm_cost", {"bf16": 1.0, "fp8": 0.5}), ("gemm_cost", {"bf16": 1.0, "fp8": 0.5, "fp4": -1}),
])
def test_bad_fields_name_themselves(field, value):
    with pytest.raises(ValueError, match=field if field != "allowed" or value != ("fp6",) else "fp6"):
        PlannerConfig(**{field: value})
