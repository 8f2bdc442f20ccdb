"""The statistics table: named scalars per planned linear, keyed by LayerKey.

One row per planned linear (forward order) plus one row of run-level scalars. Every value is a
float64 scalar, so the whole table packs into one fixed-size tensor for collectives
(`to_array` / `from_array`). NaN/Inf are kept as they are and reported per layer
(`nonfinite`), never replaced by finite numbers.

Field meanings (sums run over the micro-batches of the measured step, one data-parallel replica;
a measurement of K sampled micro-batches scales its sums up to the step, stats/microbatches.py):
  x_sq, w_sq, y_sq, gy_sq, gx_sq, gw_sq  squared Frobenius norms of X, W, Y, G_Y, G_X, G_W (G_W's
                     from the token sample, stats/tokens.py, as bwd_dgw_sq's)
  n, k, m            tokens (summed over micro-batches), in features, out features (unsharded)
  fwd_zg_clean       <z, G_Y> of the clean pass, z the forward-noise direction (+-1 entries)
  fwd_zg_noisy       <z, G~_Y> of the forward-noise pass (noise s*z added to every Y at once)
  fwd_z_sq           ||z||^2
  noise_scale        s, the forward-noise standard deviation
  bwd_dgw_sq         ||change of G_W|| ^2 in the backward-noise pass (D_j)
  bwd_eta_sq         ||eta||^2, the noise this layer injected into its G_X
  adam_du_sq         sum over weight elements of (c / (sqrt(v_hat) + eps))^2, c = (1-b1)/(1-b1^t):
                     the AdamW update change per unit gradient change, squared (lr left out)
  adam_dv_sq         sum of v_hat * (c / (sqrt(v_hat) + eps))^2, and adam_v_sum = sum of v_hat: the
                     same scale for gradient errors distributed like the gradient (see estimate)
  adam_upd_sq        sum of (m_hat / (sqrt(v_hat) + eps))^2: the BF16 update, squared (lr left out)
  adam_numel         weight elements with AdamW state (0: no state yet)
  present            1 for a row some rank measured
Per candidate precision p (field name "<field>.<p>"):
  ex, ew             ||E||^2 of the fprop input and weight
  egy_d, ew_d        ||E||^2 of the dgrad grad_output and weight
  egy_w, ex_w        ||E||^2 of the wgrad grad_output and input
  gx_ex, gw_ew       <G_X, E_X>, <G_W, E_W> (the first-order loss terms)
  dy_sq              ||dY||^2, dY = Q(X) Q(W)^T - X W^T: the output error itself, measured
  gdy_sq             sum over tokens t of <G_Y,t, dY_t>^2: the error along the loss gradient, per
                     token (n * gdy_sq is dY's quadratic form in the empirical Fisher)
Run-level scalars (the extra row): loss (mean training loss of the measured micro-batches),
num_microbatches (of the step, per replica), dp_size (data-parallel replicas; the ranks of a CP
group are one replica).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import LayerKey, forward_order

BASE_FIELDS = (
    "x_sq", "w_sq", "y_sq", "gy_sq", "gx_sq", "gw_sq", "n", "k", "m",
    "fwd_zg_clean", "fwd_zg_noisy", "fwd_z_sq", "noise_scale", "bwd_dgw_sq", "bwd_eta_sq",
    "adam_du_sq", "adam_dv_sq", "adam_v_sum", "adam_upd_sq", "adam_numel", "present",
)
ERROR_ROLES = ("ex", "ew", "egy_d", "ew_d", "egy_w", "ex_w")
PRECISION_FIELDS = ERROR_ROLES + ("gx_ex", "gw_ew", "dy_sq", "gdy_sq")
GLOBAL_FIELDS = ("loss", "num_microbatches", "dp_size")
CANDIDATES = (Precision.FP8, Precision.FP4)


def precision_field(name: str, precision: "Precision | str") -> str:
    """Column name of a per-precision field, e.g. ('ex', FP4) -> 'ex.fp4'."""
    return f"{name}.{Precision.parse(precision).value}"


def field_names(precisions: Sequence[Precision] = CANDIDATES) -> tuple[str, ...]:
    """Every column of a layer row, in the fixed order of the flat layout."""
    return BASE_FIELDS + tuple(precision_field(f, p) for p in precisions for f in PRECISION_FIELDS)


@dataclass
class StatsTable:
    """Per-layer statistics of one measurement. `values[i, j]` is field `fields[j]` of `keys[i]`."""

    keys: tuple[LayerKey, ...]
    """Planned linears, in forward order."""
    precisions: tuple[Precision, ...] = CANDIDATES
    """Candidate precisions with error columns."""
    values: np.ndarray = None
    """float64 array (len(keys), len(fields)); zeros when not given."""
    globals_: dict = field(default_factory=dict)
    """Run-level scalars (GLOBAL_FIELDS)."""

    def __post_init__(self) -> None:
        self.keys = tuple(sorted((LayerKey(*k) for k in self.keys), key=forward_order))
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("StatsTable.keys has duplicates")
        self.precisions = tuple(Precision.parse(p) for p in self.precisions)
        if Precision.BF16 in self.precisions:
            raise ValueError("StatsTable.precisions: bf16 has no quantization error; list fp8/fp4 only")
        self.fields = field_names(self.precisions)
        self._col = {f: j for j, f in enumerate(self.fields)}
        self._row = {k: i for i, k in enumerate(self.keys)}
        shape = (len(self.keys), len(self.fields))
        if self.values is None:
            self.values = np.zeros(shape)
        else:
            self.values = np.asarray(self.values, dtype=np.float64)
            if self.values.shape != shape:
                raise ValueError(f"StatsTable.values has shape {self.values.shape}, expected {shape}")
        g = {f: 0.0 for f in GLOBAL_FIELDS}
        unknown = set(self.globals_) - set(GLOBAL_FIELDS)
        if unknown:
            raise ValueError(f"StatsTable.globals_: unknown fields {sorted(unknown)}; valid: {GLOBAL_FIELDS}")
        g.update({k: float(v) for k, v in self.globals_.items()})
        self.globals_ = g

    # -- access -------------------------------------------------------------------------------
    def col(self, name: str) -> int:
        try:
            return self._col[name]
        except KeyError:
            raise ValueError(f"unknown statistics field {name!r}; valid: {', '.join(self.fields)}") from None

    def row_index(self, key) -> int:
        try:
            return self._row[LayerKey(*key)]
        except KeyError:
            raise ValueError(f"layer {key} is not in this statistics table") from None

    def get(self, key, name: str) -> float:
        return float(self.values[self.row_index(key), self.col(name)])

    def set(self, key, name: str, value: float) -> None:
        self.values[self.row_index(key), self.col(name)] = value

    def add(self, key, name: str, value: float) -> None:
        self.values[self.row_index(key), self.col(name)] += value

    def column(self, name: str) -> np.ndarray:
        """One field for every layer (a view, forward order)."""
        return self.values[:, self.col(name)]

    def row(self, key) -> dict[str, float]:
        return dict(zip(self.fields, map(float, self.values[self.row_index(key)])))

    def nonfinite(self) -> dict[LayerKey, list[str]]:
        """Layers with NaN/Inf statistics -> the offending fields."""
        bad = ~np.isfinite(self.values)
        return {k: [f for f, b in zip(self.fields, bad[i]) if b]
                for i, k in enumerate(self.keys) if bad[i].any()}

    # -- flat layout for collectives ----------------------------------------------------------
    def to_array(self) -> np.ndarray:
        """(len(keys) + 1, len(fields)) float64: layer rows, then the run-level row."""
        out = np.zeros((len(self.keys) + 1, len(self.fields)))
        out[:-1] = self.values
        out[-1, :len(GLOBAL_FIELDS)] = [self.globals_[f] for f in GLOBAL_FIELDS]
        return out

    @classmethod
    def from_array(cls, keys: Iterable, array, precisions: Sequence[Precision] = CANDIDATES) -> "StatsTable":
        array = np.asarray(array, dtype=np.float64)
        t = cls(keys=tuple(keys), precisions=tuple(precisions), values=array[:-1])
        t.globals_ = {f: float(array[-1, j]) for j, f in enumerate(GLOBAL_FIELDS)}
        return t

    def copy(self) -> "StatsTable":
        return StatsTable(keys=self.keys, precisions=self.precisions, values=self.values.copy(),
                          globals_=dict(self.globals_))

    def summary(self) -> str:
        """A short per-layer text table of the main statistics, for logs."""
        lines = [f"{'layer':<18}{'x_sq':>11}{'w_sq':>11}{'gy_sq':>11}{'kappa':>11}"]
        for k in self.keys:
            r = self.row(k)
            den = r["noise_scale"] * r["fwd_z_sq"]
            kappa = (r["fwd_zg_noisy"] - r["fwd_zg_clean"]) / den if den else math.nan
            lines.append(f"{str(k):<18}{r['x_sq']:>11.4g}{r['w_sq']:>11.4g}{r['gy_sq']:>11.4g}{kappa:>11.4g}")
        return "\n".join(lines)
