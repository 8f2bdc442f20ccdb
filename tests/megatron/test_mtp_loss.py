"""Megatron's MTP loss in SNIP's measurement passes (megatron/mtp_loss.py): the gradient it adds
follows the factor of the micro-batch being run, and the logged MTP loss is left as it was."""

import torch
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

from snip_megatron.megatron.mtp_loss import mtp_log_untouched, scaled_mtp_loss


def _mtp_grad(factor=None) -> float:
    """d(attached MTP loss = 3 w)/dw through Megatron's MTPLossAutoScaler (its step scale is 1)."""
    w = torch.tensor(2.0, requires_grad=True)
    hidden = torch.ones(3, requires_grad=True)
    if factor is None:
        out = MTPLossAutoScaler.apply(hidden * 1.0, 3.0 * w)
    else:
        with scaled_mtp_loss(lambda: factor):
            out = MTPLossAutoScaler.apply(hidden * 1.0, 3.0 * w)
    out.sum().backward()
    return float(w.grad)


def test_the_mtp_gradient_follows_the_micro_batchs_factor_and_apply_comes_back():
    saved = MTPLossAutoScaler.main_loss_backward_scale
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    try:
        assert _mtp_grad() == 3.0
        assert _mtp_grad(0.0) == 0.0  # the backward-noise micro-batches: no loss gradient
        assert _mtp_grad(0.25) == 0.75  # a sample of the step's micro-batches
        assert "apply" not in vars(MTPLossAutoScaler) and _mtp_grad() == 3.0  # Megatron's own again
    finally:
        MTPLossAutoScaler.set_loss_scale(saved)


def test_the_logged_mtp_loss_is_left_as_it_was():
    tracker = MTPLossLoggingHelper.tracker
    saved = dict(tracker)
    tracker.clear()
    try:
        tracker["loss_values"] = torch.tensor([1.0])
        kept = tracker["loss_values"]
        with mtp_log_untouched():
            tracker["loss_values"] += 5.0  # what a measurement forward adds
            tracker["total_values"] = torch.tensor([7.0])
        assert tracker.keys() == {"loss_values"} and tracker["loss_values"] is kept and float(kept) == 1.0
    finally:
        tracker.clear()
        tracker.update(saved)
