"""Loss and weight divergence: pure functions from a statistics table to a cost table.

    from snip_megatron.estimate import cost_table, EstimateConfig
    costs = cost_table(stats_table, EstimateConfig(lam=0.3))   # CostEstimate
    costs.costs[key][Precision.FP4]  # key: a LayerKey of the model's inventory

No torch modules and no collectives here (docs/method.md derives the formulas).
"""

from snip_megatron.estimate.config import EstimateConfig
from snip_megatron.estimate.cost import CostEstimate, cost_table, proxy_table

__all__ = ["EstimateConfig", "CostEstimate", "cost_table", "proxy_table"]
