import torch

from snip_megatron.megatron.batch import causal_batch, make_forward_step, masked_mean_loss, to_model_device


def test_causal_batch_shifts_labels_and_masks_the_rolled_in_token():
    tokens = torch.arange(6).view(2, 3)
    b = causal_batch(tokens)
    assert b["labels"].tolist() == [[1, 2, 0], [4, 5, 3]]
    assert b["loss_mask"].tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    assert b["attention_mask"].shape == (1, 1, 3, 3) and bool(b["attention_mask"][0, 0, 0, 1])
    assert not bool(b["attention_mask"][0, 0, 1, 0])


def test_masked_mean_loss_ignores_masked_tokens():
    loss = masked_mean_loss(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert loss.item() == 2.0


class _Model(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, device=device))
        self.seen = None

    def forward(self, tokens, position_ids, attention_mask, labels=None):
        self.seen = {t.device.type for t in (tokens, position_ids, attention_mask, labels)}
        return torch.zeros(tokens.shape, device=self.w.device)


def test_batches_follow_the_model_to_its_device():
    batch = causal_batch(torch.zeros(2, 4, dtype=torch.long))
    assert to_model_device(batch, _Model("cpu")) is batch  # already there: no copy
    moved = to_model_device(batch, _Model("meta"))
    assert {v.device.type for v in moved.values()} == {"meta"}
    model = _Model("meta")
    make_forward_step()(iter([batch]), model)
    assert model.seen == {"meta"}
