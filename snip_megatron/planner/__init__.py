"""Precision planning: the ILP (PuLP/CBC), its exact fallback, the FLOP/time models and baselines."""

from snip_megatron.planner.baselines import BASELINES, baseline_plan
from snip_megatron.planner.config import PlannerConfig
from snip_megatron.planner.costs import CostTable
from snip_megatron.planner.flops import flop_table, stage_of_layers, stages_for_keys
from snip_megatron.planner.ilp import cbc_available
from snip_megatron.planner.problem import Achieved
from snip_megatron.planner.solve import PlanResult, solve_plan

__all__ = ["BASELINES", "Achieved", "CostTable", "PlanResult", "PlannerConfig", "baseline_plan",
           "cbc_available", "flop_table", "solve_plan", "stage_of_layers", "stages_for_keys"]
