"""Megatron's multi-token-prediction loss during SNIP's measurement passes.

Megatron does not return the MTP loss from the forward step: the model attaches it to its output
with `MTPLossAutoScaler.apply(hidden_states, mtp_loss)`, whose backward adds the MTP loss's gradient
at a scale the schedule sets for the whole step (`set_loss_scale`), and it adds each forward's MTP
loss to `MTPLossLoggingHelper.tracker`, which the training log then reports ("mtp_1 loss";
transformer/multi_token_prediction.py, megatron-core 0.16 and 0.19 alike). So a measurement pass
must

- scale the MTP loss as it scales the loss the forward step returns: zero on a micro-batch whose
  loss gradient is zeroed (the backward-noise pass, where every G_Y must be the propagated noise
  only), the sample's share of the step otherwise. Its gradient is linear in the loss attached, so
  the factor multiplies the loss given to `MTPLossAutoScaler.apply`;
- leave the tracker as the step found it, so the step's logged MTP loss is the training step's.
"""

from __future__ import annotations

import contextlib
from typing import Callable


def _classes():
    try:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
    except ImportError:  # a Megatron without MTP
        return None, None
    return MTPLossAutoScaler, MTPLossLoggingHelper


@contextlib.contextmanager
def scaled_mtp_loss(factor: Callable[[], float]):
    """While open, the MTP loss of each forward is multiplied by `factor()` (read when the model
    attaches it, i.e. for the micro-batch being run)."""
    scaler, _ = _classes()
    if scaler is None:
        yield
        return
    own = "apply" in vars(scaler)  # else inherited from torch.autograd.Function
    saved = vars(scaler).get("apply")
    original = scaler.apply

    def apply(output, mtp_loss):
        f = factor()
        return original(output, mtp_loss if f == 1.0 else mtp_loss * f)

    scaler.apply = staticmethod(apply)
    try:
        yield
    finally:
        if own:
            scaler.apply = saved
        else:
            del scaler.apply


@contextlib.contextmanager
def mtp_log_untouched():
    """Megatron's MTP loss tracker as it was on entry, on exit (tensors restored in place)."""
    import torch

    _, helper = _classes()
    if helper is None:
        yield
        return
    tracker = helper.tracker
    saved = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in tracker.items()}
    try:
        yield
    finally:
        for key in [k for k in tracker if k not in saved]:
            del tracker[key]
        for key, value in saved.items():
            now = tracker.get(key)
            if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) and now.shape == value.shape:
                now.copy_(value)
            else:
                tracker[key] = value
