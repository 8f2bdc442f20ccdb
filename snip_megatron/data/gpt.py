"""Train / validation splits through Megatron's GPTDataset builder, and a resumable batch reader."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from snip_megatron.data.prepare import PreparedData


def ensure_helpers() -> None:
    """Megatron's GPTDataset needs the compiled `helpers_cpp` module.

    The 0.16.1 and 0.19.2 wheels ship it prebuilt; a source checkout needs it built once with the
    local compiler (`make` in megatron/core/datasets), which Megatron's own `compile_helpers` does.
    """
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()


@dataclass(frozen=True, kw_only=True)
class Splits:
    """GPTDataset splits of one prepared corpus."""

    train: object
    """Training GPTDataset (shuffled samples of seq_length + 1 tokens, repeated over epochs as needed)."""
    valid: object
    """Held-out GPTDataset (documents the training split never sees)."""


def build_splits(data: PreparedData, *, seq_length: int, train_samples: int, seed: int = 1234,
                 split: str = "95,5,0") -> Splits:
    """Megatron GPTDataset splits by document; call on every rank (rank 0 builds the indices first)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from snip_megatron.data.tokenizer import MegatronTokenizer

    if data.tokenizer_path is None:
        raise ValueError(f"corpus {data.prefix}: GPTDataset needs a tokenizer (pass DataConfig.tokenizer)")
    if seq_length + 1 > data.num_tokens:
        raise ValueError(f"seq_length={seq_length} is longer than the whole corpus ({data.num_tokens} tokens)")
    ensure_helpers()
    # The builder logs its whole config at INFO on every build; keep the console for our metrics.
    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([data.prefix], None),
        split=split,
        path_to_cache=str(data.cache_dir) + "/gpt_indices",
        tokenizer=MegatronTokenizer(data.tokenizer_path),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
        mmap_bin_files=True,
    )
    # None for validation: exactly one pass over the held-out documents, no repeats.
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, None, None], lambda: True, config).build()
    if train is None or len(train) == 0:
        raise ValueError(f"corpus {data.prefix}: the training split is empty at seq_length={seq_length}")
    if valid is None or len(valid) == 0:
        raise ValueError(f"corpus {data.prefix} ({data.num_docs} documents) is too small for a "
                         f"validation split '{split}' at seq_length={seq_length}; use more text")
    return Splits(train=train, valid=valid)


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack GPTDataset samples into one micro-batch."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


class BatchReader:
    """Micro-batches read in order from a dataset, starting at a sample position (for resume).

    GPTDataset already shuffles; reading it in order from `consumed` makes the data position one
    integer in the checkpoint. With data parallelism each DP rank reads its own slice of every
    global batch, as Megatron's pretraining sampler does.
    """

    def __init__(self, dataset, *, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed: int = 0, wrap: bool = True):
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed = consumed
        self.wrap = wrap

    def next_micro_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch of this DP rank; advances `consumed` by one micro-batch of every rank."""
        start = self.consumed + self.dp_rank * self.micro_batch_size
        n = len(self.dataset)
        if not self.wrap and start + self.micro_batch_size > n:
            raise StopIteration
        batch = collate([self.dataset[(start + i) % n] for i in range(self.micro_batch_size)])
        self.consumed += self.micro_batch_size * self.dp_size
        return batch

    def take(self, num_micro_batches: int) -> list[dict[str, torch.Tensor]]:
        return [self.next_micro_batch() for _ in range(num_micro_batches)]
