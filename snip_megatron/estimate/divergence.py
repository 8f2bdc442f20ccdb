"""Loss and weight divergence per layer: pure numpy over the columns of a StatsTable.

Every function returns one float64 value per layer (forward order). NaN/Inf in the inputs stay
NaN/Inf in the outputs. docs/method.md derives each formula.
"""

from __future__ import annotations

import numpy as np

from snip_megatron.formats.precision import Precision
from snip_megatron.stats.table import StatsTable, precision_field


def _c(t: StatsTable, name: str, p: "Precision | None" = None) -> np.ndarray:
    return t.column(precision_field(name, p) if p is not None else name)


def _div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den with 0 where den == 0 (an empty row), NaN kept."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = num / den
    return np.where(den == 0, np.where(np.isfinite(num), 0.0, num), out)


def noise_curvature(t: StatsTable) -> np.ndarray:
    """kappa_l = <eps, G~_Y - G_Y> / ||eps||^2 from the forward-noise pass (unclamped)."""
    return _div(_c(t, "fwd_zg_noisy") - _c(t, "fwd_zg_clean"), _c(t, "noise_scale") * _c(t, "fwd_z_sq"))


def fisher_curvature(t: StatsTable) -> np.ndarray:
    """kappa_l ~ ||G_Y||^2 / m: the empirical Fisher (Gauss-Newton) of a mean token loss along a
    random direction of Y_l, from the clean pass alone (docs/method.md)."""
    return _div(_c(t, "gy_sq"), _c(t, "m"))


def curvature(t: StatsTable, floor: float = 0.0, kind: str = "mean") -> np.ndarray:
    """The scalar curvature the loss divergence uses ("noise", "fisher" or their "mean"), clamped
    at floor. "fisher_error" and "mean_error" have no scalar curvature (they use the Fisher along
    the measured error); for them the random-direction "fisher" and "mean" are returned."""
    if kind == "noise":
        kappa = noise_curvature(t)
    elif kind in ("fisher", "fisher_error"):
        kappa = fisher_curvature(t)
    else:
        kappa = 0.5 * (np.maximum(noise_curvature(t), 0.0) + fisher_curvature(t))
    return np.where(np.isnan(kappa), kappa, np.maximum(kappa, floor))


def output_error_sq(t: StatsTable, p: Precision) -> np.ndarray:
    """||dY||^2 ~ (||E_X||^2 ||W||^2 + ||X||^2 ||E_W||^2) / k (random-error model)."""
    return _div(_c(t, "ex", p) * _c(t, "w_sq") + _c(t, "x_sq") * _c(t, "ew", p), _c(t, "k"))


def measured_output_error_sq(t: StatsTable, p: Precision) -> np.ndarray:
    """||dY||^2 as measured: dY = Q(X) Q(W)^T - X W^T on the clean pass's token sample."""
    return _c(t, "dy_sq", p)


def fisher_along_error(t: StatsTable, p: Precision) -> np.ndarray:
    """dY^T F dY = n sum_t <G_Y,t, dY_t>^2: the empirical Fisher's quadratic form along the
    measured output error itself (n tokens; docs/method.md), not along a random direction."""
    return _c(t, "n") * _c(t, "gdy_sq", p)


def loss_divergence(t: StatsTable, p: Precision, *, first_order: bool = False,
                    kappa_floor: float = 0.0, curvature_kind: str = "mean",
                    output_error: str = "model") -> np.ndarray:
    """dL_l(p) = 1/2 kappa_l ||dY||^2, or 1/2 dY^T F dY with curvature_kind "fisher_error"
    (+ <G_X, E_X> + <G_W, E_W> when first_order)."""
    dy = measured_output_error_sq(t, p) if output_error == "measured" else output_error_sq(t, p)
    if curvature_kind == "fisher_error":
        dl = 0.5 * fisher_along_error(t, p)
    elif curvature_kind == "mean_error":  # two estimates of dY^T H dY with independent noise
        dl = 0.5 * 0.5 * (curvature(t, kappa_floor, "noise") * dy + fisher_along_error(t, p))
    else:
        dl = 0.5 * curvature(t, kappa_floor, curvature_kind) * dy
    if first_order:
        dl = dl + _c(t, "gx_ex", p) + _c(t, "gw_ew", p)
    return dl


def own_grad_error_sq(t: StatsTable, p: Precision) -> np.ndarray:
    """||dG_W||^2 ~ (||E_GY||^2 ||X||^2 + ||G_Y||^2 ||E_X'||^2) / n, wgrad operands."""
    return _div(_c(t, "egy_w", p) * _c(t, "x_sq") + _c(t, "gy_sq") * _c(t, "ex_w", p), _c(t, "n"))


def upstream_grad_error_sq(t: StatsTable, p: Precision) -> np.ndarray:
    """||dG_X||^2 ~ (||E_GY||^2 ||W||^2 + ||G_Y||^2 ||E_W'||^2) / m, dgrad operands."""
    return _div(_c(t, "egy_d", p) * _c(t, "w_sq") + _c(t, "gy_sq") * _c(t, "ew_d", p), _c(t, "m"))


def propagation_gain(t: StatsTable) -> np.ndarray:
    """g_j = D_j / sum_{l after j} ||eta_l||^2: weight-gradient energy per unit of noise energy
    injected into the input gradients of all later layers (backward-noise pass)."""
    eta = _c(t, "bwd_eta_sq")
    later = np.concatenate([np.cumsum(eta[::-1])[::-1][1:], [0.0]])  # sum over l > j
    return _div(_c(t, "bwd_dgw_sq"), later)


def adam_scales(t: StatsTable, model: str = "proportional") -> tuple[np.ndarray, float]:
    """(a_l, U): squared AdamW update change per unit squared gradient change, and the squared
    norm of the BF16 update over all planned linears. model "uniform": the error spread evenly
    over the weights (a = mean of c^2/(sqrt v+eps)^2); "proportional": spread like the gradient's
    second moment v (a = sum v c^2/(sqrt v+eps)^2 / sum v).
    Without optimizer state (before the first step) falls back to plain SGD: a = 1, U = sum ||G_W||^2
    (over a DP layout's per-micro-batch gradients, which are dp times the step's: /dp, so DP=n
    and one process give the same U)."""
    numel = _c(t, "adam_numel")
    if (numel > 0).all():
        if model == "uniform" or not (_c(t, "adam_v_sum") > 0).all():  # (tables without v sums)
            a = _div(_c(t, "adam_du_sq"), numel)
        else:
            a = _div(_c(t, "adam_dv_sq"), _c(t, "adam_v_sum"))
        return a, float(_c(t, "adam_upd_sq").sum())
    dp = max(t.globals_.get("dp_size", 1.0), 1.0)
    return np.ones(len(t.keys)), float(_c(t, "gw_sq").sum()) / dp


def weight_divergence(t: StatsTable, p: Precision, adam_error_model: str = "proportional") -> np.ndarray:
    """WD_l(p) = [a_l ||dG_W,l||^2 + ||dG_X,l||^2 sum_{j before l} g_j a_j] / (dp * U).

    Own weight-gradient error plus the error sent upstream, each turned into an AdamW update
    error, relative to the whole BF16 update. dp: replicas average their independent errors."""
    a, total = adam_scales(t, adam_error_model)
    ga = propagation_gain(t) * a
    before = np.concatenate([[0.0], np.cumsum(ga)[:-1]])  # sum over j < l
    dp = max(t.globals_.get("dp_size", 1.0), 1.0)
    wd = a * own_grad_error_sq(t, p) + upstream_grad_error_sq(t, p) * before
    return wd / (dp * total) if total > 0 else np.full(len(t.keys), np.nan)


def relative_error(t: StatsTable, p: Precision) -> np.ndarray:
    """The proxy: ||E_X||^2 / ||X||^2 + ||E_W||^2 / ||W||^2 (fprop operands; no sensitivity)."""
    return _div(_c(t, "ex", p), _c(t, "x_sq")) + _div(_c(t, "ew", p), _c(t, "w_sq"))
