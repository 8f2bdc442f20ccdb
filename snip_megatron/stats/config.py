"""Settings of a measurement (statistics step + the two noise passes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.stats.table import CANDIDATES


@dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    """What one measurement collects and how it injects noise."""

    noise_frac: float = 0.05
    """Forward noise standard deviation as a fraction of rms(Y) of each layer (kappa did not depend
    on it between 2% and 5% in our measurements). In a run, SnipConfig.noise_scale sets this."""
    bwd_noise_frac: float = 1.0
    """Backward noise standard deviation as a fraction of rms(G_X). The backward-noise pass runs
    with a zero loss gradient, so it is exactly linear and the gains do not depend on this."""
    seed: int = 0
    """Seed of the dedicated noise and stochastic-rounding generators (never the global RNG). In a
    run, SnipConfig.seed sets this."""
    precisions: tuple = CANDIDATES
    """Candidate precisions whose quantization errors are collected."""
    first_order: bool = True
    """Collect <G_X, E_X> (keeps each layer's fprop input error until its backward)."""
    error_token_stride: int = 4
    """Quantization errors of activations and gradients are measured on every `stride`-th chunk
    of 16 consecutive tokens and scaled up (they are sums over tokens); 1 = every token. On CPU
    emulation the errors cost more than the passes themselves; weights use every element."""
    interleave_noise: bool = True
    """Run the two noise passes as one: forward noise on the even micro-batches, backward noise on
    the odd ones (for a step of one micro-batch, the noise pass runs its two halves along the batch
    dim; the clean pass keeps it whole). Saves a
    forward and backward of the step at the price of half the data per noise estimate. Falls back
    to two passes for a step of a single sequence."""
    grad_error_token_stride: int = 8
    """The same for the backward-GEMM roles (X for wgrad, G_Y for dgrad and wgrad), which only
    feed the weight divergence: sums of squared errors, spread evenly over tokens, so a sparser
    sample serves them (the forward roles also feed dY and its per-token projections)."""
    micro_batches: "int | None" = 8
    """K: micro-batches of the step measured, spread over the global batch and the data-parallel
    replicas (stats/microbatches.py: each replica measures its share at evenly spaced positions;
    deterministic). Their sums are scaled up to the whole step, so the table estimates the same
    fields as measuring every micro-batch. None or 0: every micro-batch. In a run,
    SnipConfig.measure_micro_batches sets this."""
    formats: Formats = Formats()
    """The FP8/FP4 formats whose quantization errors are measured. In a run, SnipConfig.formats
    sets this (the formats the planned linears run)."""

    def __post_init__(self) -> None:
        for name in ("noise_frac", "bwd_noise_frac"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"MeasureConfig.{name} must be a finite number > 0, got {v!r}")
        if not isinstance(self.interleave_noise, bool):
            raise ValueError(f"MeasureConfig.interleave_noise must be a bool, got {self.interleave_noise!r}")
        for name in ("error_token_stride", "grad_error_token_stride"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MeasureConfig.{name} must be a positive integer, got {v!r}")
        k = self.micro_batches
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ValueError(f"MeasureConfig.micro_batches must be None, 0 (every micro-batch) or a "
                             f"positive integer, got {k!r}")
        ps = tuple(Precision.parse(p) for p in self.precisions)
        if not ps or Precision.BF16 in ps:
            raise ValueError(f"MeasureConfig.precisions must list fp8 and/or fp4, got {self.precisions!r}")
