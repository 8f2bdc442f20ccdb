"""Statistics table -> cost table (layer x precision): the estimator's entry point."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from snip_megatron.estimate import divergence as dv
from snip_megatron.estimate.config import EstimateConfig
from snip_megatron.formats.precision import Precision
from snip_megatron.plan import LayerKey
from snip_megatron.stats.table import StatsTable

Table = dict  # dict[LayerKey, dict[Precision, float]]


@dataclass
class CostEstimate:
    """Q_l(p) per planned linear and precision, with its parts for reporting.

    NaN costs mark layers whose statistics were not finite (`nonfinite`); the planner keeps the
    previous precision for them."""

    costs: Table
    """Q_l(p) = dL_l(p) / L + lam * WD_l(p); Q_l(BF16) = 0."""
    loss_div: Table
    """dL_l(p) / L, the relative loss divergence."""
    weight_div: Table
    """WD_l(p), normalised by the squared BF16 update."""
    kappa: dict = field(default_factory=dict)
    """Curvature per layer (forward-noise pass)."""
    gain: dict = field(default_factory=dict)
    """Propagation gain per layer (backward-noise pass)."""
    nonfinite: dict = field(default_factory=dict)
    """LayerKey -> statistics fields that were NaN/Inf."""

    @property
    def keys(self) -> list[LayerKey]:
        return list(self.costs)

    def column(self, p: "Precision | str", part: str = "costs") -> np.ndarray:
        """One precision's values over the layers (forward order); part: costs|loss_div|weight_div."""
        p = Precision.parse(p)
        return np.array([getattr(self, part)[k][p] for k in self.costs])

    def format(self) -> str:
        ps = [p for p in next(iter(self.costs.values()))] if self.costs else []
        head = f"{'layer':<18}{'kappa':>10}{'gain':>10}" + "".join(
            f"{'dL/L.' + p.value:>12}{'WD.' + p.value:>12}{'Q.' + p.value:>12}" for p in ps if p is not Precision.BF16)
        lines = [head]
        for k in self.costs:
            s = f"{str(k):<18}{self.kappa.get(k, math.nan):>10.3g}{self.gain.get(k, math.nan):>10.3g}"
            for p in ps:
                if p is not Precision.BF16:
                    s += f"{self.loss_div[k][p]:>12.3g}{self.weight_div[k][p]:>12.3g}{self.costs[k][p]:>12.3g}"
            lines.append(s + ("  NONFINITE" if k in self.nonfinite else ""))
        return "\n".join(lines)


def cost_table(stats: StatsTable, config: EstimateConfig = EstimateConfig()) -> CostEstimate:
    """The cost of running each planned linear in each candidate precision (BF16 costs 0)."""
    loss = stats.globals_.get("loss", 0.0)
    if not (math.isfinite(loss) and loss > 0):
        raise ValueError(f"statistics field 'loss' must be a finite positive training loss, got {loss!r}")
    bad = stats.nonfinite()
    keys = stats.keys
    if bad:
        # zero the bad rows so they cannot poison the sums other layers use; they get NaN below
        stats = stats.copy()
        for k in bad:
            stats.values[stats.row_index(k)] = 0.0
    _check_measured_error(stats, config)
    kappa = dv.curvature(stats, config.kappa_floor, config.curvature)
    gain = dv.propagation_gain(stats)
    costs, ldiv, wdiv = ({k: {Precision.BF16: 0.0} for k in keys} for _ in range(3))
    for p in stats.precisions:
        dl = dv.loss_divergence(stats, p, first_order=config.first_order, kappa_floor=config.kappa_floor,
                                curvature_kind=config.curvature, output_error=config.output_error) / loss
        wd = dv.weight_divergence(stats, p, config.adam_error_model)
        q = dl + config.lam * wd
        for i, k in enumerate(keys):
            # a layer with any non-finite statistic gets NaN, never a finite cost
            nan = k in bad
            ldiv[k][p] = math.nan if nan else float(dl[i])
            wdiv[k][p] = math.nan if nan else float(wd[i])
            costs[k][p] = math.nan if nan else float(q[i])
    return CostEstimate(costs=costs, loss_div=ldiv, weight_div=wdiv,
                     kappa={k: float(v) for k, v in zip(keys, kappa)},
                     gain={k: float(v) for k, v in zip(keys, gain)}, nonfinite=bad)


def _check_measured_error(stats: StatsTable, config: EstimateConfig) -> None:
    """A configuration that reads the measured output error refuses a table without it (one
    measured before the dy_sq / gdy_sq fields existed), instead of costing every layer zero."""
    if not config.reads_measured_error:
        return
    for p in stats.precisions:
        has_error = (stats.column(f"ex.{p.value}") > 0) | (stats.column(f"ew.{p.value}") > 0)
        missing = has_error & (stats.column(f"dy_sq.{p.value}") == 0)
        if missing.any():
            first = stats.keys[int(np.argmax(missing))]
            raise ValueError(f"statistics have quantization errors but no measured output error "
                             f"(dy_sq.{p.value} is 0 for {int(missing.sum())} layers, first {first}); "
                             f"EstimateConfig(curvature={config.curvature!r}, output_error="
                             f"{config.output_error!r}) needs them: measure again, or use "
                             f"curvature='mean', output_error='model'")


def proxy_table(stats: StatsTable) -> Table:
    """The relative-quantization-error proxy as a cost table (for the min-relative-error baseline)."""
    out = {k: {Precision.BF16: 0.0} for k in stats.keys}
    for p in stats.precisions:
        for k, v in zip(stats.keys, dv.relative_error(stats, p)):
            out[k][p] = float(v)
    return out
