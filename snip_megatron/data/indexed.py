"""Token streams to and from Megatron's indexed dataset format (``prefix.bin`` + ``prefix.idx``)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder


def write_indexed(prefix: "str | Path", documents: Iterable[list[int]], vocab_size: int) -> tuple[int, int]:
    """Write one sequence per document; returns (documents, tokens) written."""
    dtype = DType.optimal_dtype(vocab_size)  # uint16 below 65500 tokens, as Megatron's preprocess
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    docs = tokens = 0
    for ids in documents:
        array = np.asarray(ids, dtype=dtype)
        builder.add_document(array, [array.size])
        docs += 1
        tokens += array.size
    builder.finalize(f"{prefix}.idx")
    return docs, tokens


def read_indexed(prefix: "str | Path") -> IndexedDataset:
    """Open an indexed dataset; a missing or unreadable pair raises ValueError naming the prefix."""
    prefix = str(prefix)
    for ext in (".bin", ".idx"):
        if not Path(prefix + ext).is_file():
            raise ValueError(f"indexed dataset {prefix}: {prefix + ext} does not exist")
    try:
        return IndexedDataset(prefix, mmap=True)
    except (AssertionError, OSError, ValueError) as e:
        raise ValueError(f"indexed dataset {prefix} is not a valid Megatron .bin/.idx pair: {e}") from None


def token_stream(dataset: IndexedDataset) -> np.ndarray:
    """Every token of every document, concatenated (for tests and small corpora)."""
    if len(dataset) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.asarray(dataset[i], dtype=np.int64) for i in range(len(dataset))])
