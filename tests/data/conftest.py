"""A small, deterministic slice of the default corpus (the stdlib sources), prepared once per session."""

from __future__ import annotations

import pytest

from snip_megatron.data.prepare import DataConfig, prepare

# ~120k tokens: enough for a tokenizer and both splits, quick on 2 cores.
SMALL = dict(corpus="stdlib", vocab_size=1024, max_bytes=400_000)


@pytest.fixture(scope="session")
def small_config(tmp_path_factory) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path_factory.mktemp("snip-data")), **SMALL)


@pytest.fixture(scope="session")
def small_data(small_config):
    return prepare(small_config)
