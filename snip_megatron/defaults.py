"""The controller's measurement, estimate and solver when none is injected: SNIP's own, each built
from the one SnipConfig (tests give SnipController fakes instead)."""

from __future__ import annotations

from snip_megatron.config import SnipConfig


def measure(config: SnipConfig):
    measure_config = config.measure_config()

    def run(ctx, step):
        from snip_megatron.stats import measure_step

        return measure_step(ctx, measure_config)
    return run


def estimate(config: SnipConfig):
    estimate_config = config.estimate_config()

    def run(stats):
        from snip_megatron.estimate.cost import cost_table

        return cost_table(stats, estimate_config)
    return run


def solve(config: SnipConfig):
    planner_config = config.planner_config()

    def run(costs, flops, *, previous=None, stages=None, pinned=None):
        from snip_megatron.planner.solve import solve_plan

        return solve_plan(costs, flops, planner_config, previous=previous, stages=stages, pinned=pinned)
    return run
