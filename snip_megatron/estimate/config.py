"""Settings of the cost estimator."""

from __future__ import annotations

import math
from dataclasses import dataclass


ERROR_CURVATURES = ("fisher_error", "mean_error")  # read the Fisher along the measured dY
CURVATURES = ("noise", "fisher", "mean") + ERROR_CURVATURES


@dataclass(frozen=True, kw_only=True)
class EstimateConfig:
    """How statistics become per-layer costs Q_l(p) = dL_l(p) / L + lam * WD_l(p)."""

    lam: float = 0.3
    """Weight of the (normalised) weight divergence against the relative loss divergence. 0.3 has
    the best mean long-horizon score of bench/estimator_fidelity.py over two NVFP4 runs on
    llama_tiny (lambda 0 / 0.3 / 1 / 3: 0.35 / 0.43 / 0.41 / 0.33; docs/method.md, section 7).
    That truth is noisy (seed-vs-seed agreement 0.32-0.67): re-check on real models. In a run,
    SnipConfig.lambda_wd sets this."""
    first_order: bool = False
    """Add the signed first-order loss term <G_X, E_X> + <G_W, E_W>. Off by default: it was noise
    late in training in our measurements; turn on only when averaged over many batches."""
    curvature: str = "mean_error"
    """Curvature of the loss along the output error of layer l. A scalar kappa_l times ||dY||^2:
    "noise" (forward-noise pass, one-sample Hutchinson), "fisher" (empirical Fisher / Gauss-Newton
    along a random direction, ||G_Y||^2 / m, from the clean pass) or the "mean" of the two (they
    estimate the same quantity with independent noise). Or "fisher_error": the empirical Fisher's
    quadratic form along the measured dY itself, n sum_t <G_Y,t, dY_t>^2; or "mean_error": the mean
    of that and the noise curvature times ||dY||^2 (docs/method.md, section 3)."""
    output_error: str = "measured"
    """||dY||^2 for the scalar curvatures: "model" (random-error model from the operands' norms and
    errors) or "measured" (Q(X) Q(W)^T - X W^T on the token sample)."""
    adam_error_model: str = "proportional"
    """How a layer's gradient error spreads over its weights, for the AdamW scale: "proportional"
    (like the gradient: E|du|^2 = c^2 |e|^2 sum(v/(sqrt v+eps)^2) / sum(v)) or "uniform"
    (E|du|^2 = c^2 |e|^2 mean(1/(sqrt v+eps)^2), dominated by the weights with the smallest v)."""
    kappa_floor: float = 0.0
    """Curvatures below this are clamped to it (a negative one-sample estimate is noise)."""

    @property
    def reads_measured_error(self) -> bool:
        """Whether the costs read the measured output error (dy_sq / gdy_sq statistics)."""
        return self.output_error == "measured" or self.curvature in ERROR_CURVATURES

    def __post_init__(self) -> None:
        if not (isinstance(self.lam, (int, float)) and math.isfinite(self.lam) and self.lam >= 0):
            raise ValueError(f"EstimateConfig.lam must be a finite number >= 0, got {self.lam!r}")
        if self.curvature not in CURVATURES:
            raise ValueError(f"EstimateConfig.curvature must be one of {', '.join(CURVATURES)}, "
                             f"got {self.curvature!r}")
        if self.output_error not in ("model", "measured"):
            raise ValueError(f"EstimateConfig.output_error must be 'model' or 'measured', got {self.output_error!r}")
        if self.adam_error_model not in ("proportional", "uniform"):
            raise ValueError(f"EstimateConfig.adam_error_model must be 'proportional' or 'uniform', "
                             f"got {self.adam_error_model!r}")
        if not (isinstance(self.kappa_floor, (int, float)) and math.isfinite(self.kappa_floor)):
            raise ValueError(f"EstimateConfig.kappa_floor must be a finite number, got {self.kappa_floor!r}")
