"""A byte-level BPE tokenizer trained locally with `tokenizers`, or loaded from a local file.

Byte-level BPE needs no vocabulary download and round-trips any text exactly, so the stdlib corpus
(and anything else) is tokenized without an <unk> token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import Tokenizer
from tokenizers.implementations import ByteLevelBPETokenizer

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN)
# 256 byte symbols plus the special tokens: the smallest byte-level vocabulary.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts` (deterministic for the same texts in the same order)."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an integer >= {MIN_VOCAB_SIZE} (256 bytes + "
                         f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}")
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                            special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    return bpe._tokenizer  # the plain Tokenizer: saves to and loads from one tokenizer.json


def load_tokenizer(path: "str | Path") -> Tokenizer:
    """A tokenizer saved as a `tokenizers` JSON file (a folder means its tokenizer.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer {path} does not exist (expected a tokenizers JSON file)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for bad files
        raise ValueError(f"tokenizer {path} could not be loaded: {e}") from None


def file_digest(path: "str | Path") -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class MegatronTokenizer(MegatronTokenizerBase):
    """The few things Megatron's GPTDataset reads from a tokenizer: vocab size, EOD and pad ids."""

    def __init__(self, path: "str | Path"):
        path = Path(path)
        self._tok = load_tokenizer(path)
        super().__init__(str(path), {})
        self._eod = self._tok.token_to_id(EOD_TOKEN)
        self._pad = self._tok.token_to_id(PAD_TOKEN)
        if self._eod is None:
            raise ValueError(f"tokenizer {path} has no end-of-document token {EOD_TOKEN!r}")
        # GPTDataset hashes this into its index cache key, so a new tokenizer gets new indices.
        self.unique_identifiers = {"class": type(self).__name__, "sha256": file_digest(self.path),
                                   "vocab_size": self.vocab_size}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        # No pad token: Megatron then uses an id that never occurs in data.
        if self._pad is None:
            raise AttributeError("tokenizer has no pad token")
        return self._pad

    def vocab(self) -> dict:
        return self._tok.get_vocab(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("plain pretraining tokenizer: no chat template")
