"""Causal-LM micro-batches in the form Megatron's GPTModel.forward takes."""

from __future__ import annotations

import torch


def causal_batch(tokens: torch.Tensor, labels: torch.Tensor | None = None,
                 loss_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """tokens [b, s] (and labels, default tokens shifted left) -> GPTModel inputs + loss mask."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    b, s = tokens.shape
    if labels is None:
        labels = torch.roll(tokens, -1, dims=1)
        if loss_mask is None:
            loss_mask = torch.ones(b, s)
            loss_mask[:, -1] = 0.0  # the rolled-in last label is not a real next token
    if loss_mask is None:
        loss_mask = torch.ones(b, s)
    # Megatron's local attention takes a boolean mask where True means "masked out".
    attention_mask = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    return dict(tokens=tokens, labels=labels, position_ids=position_ids,
                attention_mask=attention_mask, loss_mask=loss_mask.float())


def random_batch(batch_size: int, seq_length: int, vocab_size: int,
                 generator: torch.Generator) -> dict[str, torch.Tensor]:
    return causal_batch(torch.randint(0, vocab_size, (batch_size, seq_length), generator=generator))


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.to(per_token_loss.device).float()
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp(min=1.0)


def to_model_device(batch: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """The batch on the device of the model's parameters (batches are built on the CPU)."""
    param = next(model.parameters(), None)
    if param is None or all(v.device == param.device for v in batch.values()):
        return batch
    return {k: v.to(param.device, non_blocking=True) for k, v in batch.items()}


def make_forward_step(loss_key: str = "lm loss"):
    """A `forward_step_func` for Megatron's schedules: batch dicts in, masked mean loss out."""

    def forward_step(data_iterator, model):
        batch = to_model_device(next(data_iterator), model)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                       labels=batch["labels"])

        def loss_func(output_tensor):
            loss = masked_mean_loss(output_tensor, batch["loss_mask"])
            # The schedule divides the returned loss in place: report a detached copy.
            return loss, {loss_key: loss.detach().clone()}

        return output, loss_func

    return forward_step


def on_this_cp_rank(batch: dict, cp_group) -> dict:
    """Megatron's split of a micro-batch's [b, s] tensors to this context-parallel rank's tokens."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    # compat: megatron-core 0.16's get_batch_on_this_cp_rank has no is_hybrid_cp (0.19 requires it)
    hybrid = "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters
    return get_batch_on_this_cp_rank(batch, **({"is_hybrid_cp": False} if hybrid else {}), cp_group=cp_group)
