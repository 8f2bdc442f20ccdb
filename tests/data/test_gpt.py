import numpy as np
import pytest
import torch

from snip_megatron.data.gpt import BatchReader, build_splits


@pytest.fixture(scope="module")
def splits(small_data):
    return build_splits(small_data, seq_length=64, train_samples=500, seed=7)


def test_splits_are_megatron_gpt_datasets_on_disjoint_documents(splits, small_data):
    from megatron.core.datasets.gpt_dataset import GPTDataset

    assert isinstance(splits.train, GPTDataset) and isinstance(splits.valid, GPTDataset)
    assert len(splits.train) >= 500 and len(splits.valid) > 0
    train_docs, valid_docs = set(splits.train.document_index), set(splits.valid.document_index)
    assert train_docs and valid_docs and not train_docs & valid_docs
    sample = splits.train[0]
    assert sample["tokens"].shape == (64,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])  # next-token labels
    assert int(sample["tokens"].max()) < small_data.vocab_size


def test_index_cache_is_reused(splits, small_data):
    again = build_splits(small_data, seq_length=64, train_samples=500, seed=7)
    assert np.array_equal(again.train.shuffle_index, splits.train.shuffle_index)
    assert torch.equal(again.train[3]["tokens"], splits.train[3]["tokens"])


def test_batch_reader_resumes_at_a_position(splits):
    reader = BatchReader(splits.train, micro_batch_size=4)
    first = reader.take(3)
    resumed = BatchReader(splits.train, micro_batch_size=4, consumed=8)
    assert reader.consumed == 12
    assert torch.equal(resumed.next_micro_batch()["tokens"], first[2]["tokens"])
    assert first[0]["attention_mask"].shape == (4, 1, 64, 64)
    # Data parallel: the two ranks read the two halves of each global batch.
    r0 = BatchReader(splits.train, micro_batch_size=2, dp_rank=0, dp_size=2).next_micro_batch()
    r1 = BatchReader(splits.train, micro_batch_size=2, dp_rank=1, dp_size=2).next_micro_batch()
    assert torch.equal(torch.cat([r0["tokens"], r1["tokens"]]), first[0]["tokens"])


def test_sequence_longer_than_corpus_raises(small_data):
    with pytest.raises(ValueError, match="seq_length"):
        build_splits(small_data, seq_length=small_data.num_tokens + 10, train_samples=10)
