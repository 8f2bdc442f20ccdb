"""A tiny model and a small slice of the default corpus, shared by the training tests."""

from __future__ import annotations

import pytest

from snip_megatron.data.prepare import DataConfig, prepare
from snip_megatron.shapes import ModelShape
from snip_megatron.train.config import TrainConfig

TINY = ModelShape(name="tiny_test", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                  num_attention_heads=4, num_query_groups=2, vocab_size=1024, seq_length=64)


@pytest.fixture(scope="session")
def data_config(tmp_path_factory) -> DataConfig:
    config = DataConfig(corpus="stdlib", vocab_size=TINY.vocab_size, max_bytes=1_000_000,
                        cache_dir=str(tmp_path_factory.mktemp("snip-data")))
    prepare(config)  # tokenize once for the whole session
    return config


@pytest.fixture
def tiny_config(data_config):
    """TrainConfig for the tiny model; tests override fields with `tiny_config(steps=...)`."""

    def make(**overrides) -> TrainConfig:
        fields = dict(model=TINY, data=data_config, steps=4, micro_batch_size=4, lr=3e-3,
                      warmup_steps=1, eval_interval=None, eval_batches=4, progress=False)
        fields.update(overrides)
        return TrainConfig(**fields)

    return make
