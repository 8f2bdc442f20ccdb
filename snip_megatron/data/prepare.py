"""Corpus -> tokenizer -> Megatron indexed dataset, cached by content hash.

    python -m snip_megatron.data.prepare --corpus stdlib --out .cache/snip-data --vocab-size 4096

The cache key covers the documents' text, the source options and the tokenizer (its vocabulary
size when trained here, its file's hash when loaded), so a second run with the same inputs reuses
the tokenizer and the .bin/.idx files instead of tokenizing again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from snip_megatron.data.indexed import read_indexed, write_indexed
from snip_megatron.data.sources import IndexedSource, TextSource, parse_corpus
from snip_megatron.data.tokenizer import MIN_VOCAB_SIZE, file_digest, load_tokenizer, train_bpe

# Bump when the layout or the tokenization changes, so old caches are not reused.
CACHE_VERSION = 1
DEFAULT_CACHE_DIR = ".cache/snip-data"
META = "meta.json"
PREFIX = "tokens"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What to read and how to tokenize it."""

    corpus: str = "stdlib"
    """Corpus spec: "stdlib", a folder, a glob, file.jsonl[:field] or a Megatron .bin/.idx prefix."""
    cache_dir: str = DEFAULT_CACHE_DIR
    """Folder for tokenizers, token files and GPTDataset indices (one sub-folder per content hash)."""
    vocab_size: int = 4096
    """Vocabulary size of a tokenizer trained here (ignored when `tokenizer` is given)."""
    tokenizer: str | None = None
    """Path of an existing tokenizers JSON file (or a folder with tokenizer.json); None trains one."""
    text_field: str | None = None
    """JSONL text key (default "text"); "file.jsonl:key" in `corpus` does the same."""
    max_docs: int | None = None
    """Use only the first this many documents (deterministic)."""
    max_bytes: int | None = None
    """Use only the first documents up to this many UTF-8 bytes (deterministic)."""

    def __post_init__(self) -> None:
        if self.tokenizer is None and (not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool)
                                       or self.vocab_size < MIN_VOCAB_SIZE):
            raise ValueError(f"DataConfig.vocab_size must be an integer >= {MIN_VOCAB_SIZE}, "
                             f"got {self.vocab_size!r}")
        if not self.cache_dir:
            raise ValueError("DataConfig.cache_dir must be a folder path")


@dataclass(frozen=True, kw_only=True)
class PreparedData:
    """A tokenized corpus on disk, ready for GPTDataset."""

    prefix: str
    """Megatron .bin/.idx path prefix."""
    tokenizer_path: str | None
    """tokenizers JSON file (None for an indexed corpus given without one)."""
    vocab_size: int
    """Tokenizer vocabulary size (or max token id + 1 when there is no tokenizer)."""
    num_docs: int
    """Documents (one sequence each)."""
    num_tokens: int
    """Tokens, end-of-document tokens included."""
    digest: str
    """Content hash of corpus + tokenizer (names the cache folder)."""
    cache_dir: str
    """Folder for derived indices (GPTDataset's shuffles and sample indices)."""
    reused: bool = False
    """True when the cache already held this corpus and nothing was tokenized."""


def prepare(config: DataConfig, *, progress: bool = False) -> PreparedData:
    """Tokenize `config.corpus` into the cache (or find it there) and describe the result."""
    source = parse_corpus(config.corpus, text_field=config.text_field, max_docs=config.max_docs,
                          max_bytes=config.max_bytes)
    if isinstance(source, IndexedSource):
        return _prepare_indexed(source, config)
    return _prepare_text(source, config, progress=progress)


def _prepare_text(source: TextSource, config: DataConfig, *, progress: bool) -> PreparedData:
    # Pass 1: hash the documents (cheap next to tokenizing; it is what makes the cache safe).
    h = hashlib.sha256()
    num_docs = 0
    for doc in source.documents():
        data = doc.text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
        num_docs += 1
    if num_docs == 0:
        raise ValueError(f"corpus {source.spec!r} is empty: no non-blank documents")
    tokenizer_key = ({"loaded": file_digest(_tokenizer_file(config.tokenizer))} if config.tokenizer
                     else {"trained": "byte_level_bpe", "vocab_size": config.vocab_size})
    key = {"version": CACHE_VERSION, "source": source.describe(), "tokenizer": tokenizer_key,
           "documents": h.hexdigest()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(config.cache_dir) / digest
    if (root / META).is_file():
        return _load_meta(root, reused=True)

    tmp = Path(config.cache_dir) / f".{digest}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # Pass 2: the tokenizer, trained on the same documents or loaded.
        t0 = time.perf_counter()
        if config.tokenizer:
            tok = load_tokenizer(config.tokenizer)
        else:
            if progress:
                print(f"training byte-level BPE (vocab {config.vocab_size}) on {num_docs} documents",
                      file=sys.stderr)
            tok = train_bpe((d.text for d in source.documents()), config.vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
        eod = tok.token_to_id("<|endoftext|>")
        if eod is None:
            raise ValueError(f"tokenizer {config.tokenizer} has no '<|endoftext|>' token to end documents")
        t_tok = time.perf_counter() - t0

        # Pass 3: tokenize, one sequence per document, each ending in the end-of-document token.
        t0 = time.perf_counter()
        bar = tqdm(total=num_docs, unit="doc", desc="tokenizing", disable=not progress)

        def encoded():
            batch = []
            for doc in source.documents():
                batch.append(doc.text)
                if len(batch) == 64:
                    yield from _encode(tok, batch, eod, bar)
                    batch = []
            yield from _encode(tok, batch, eod, bar)

        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        docs, tokens = write_indexed(tmp / PREFIX, encoded(), vocab_size)
        bar.close()
        meta = {"key": key, "digest": digest, "num_docs": docs, "num_tokens": tokens,
                "vocab_size": vocab_size, "corpus": source.spec,
                "seconds": {"tokenizer": round(t_tok, 3), "tokenize": round(time.perf_counter() - t0, 3)}}
        # meta.json is written last and the folder renamed into place: a cache folder with
        # meta.json is always complete, whatever interrupted an earlier run.
        (tmp / META).write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, root)
        except OSError:
            if not (root / META).is_file():  # another process finished first: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load_meta(root, reused=False)


def _encode(tok, texts, eod, bar):
    if not texts:
        return
    for enc in tok.encode_batch(texts):
        ids = enc.ids
        ids.append(eod)
        yield ids
    bar.update(len(texts))


def _tokenizer_file(path: str) -> Path:
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"DataConfig.tokenizer: {path} does not exist (expected a tokenizers JSON file)")
    return p


def _load_meta(root: Path, *, reused: bool) -> PreparedData:
    meta = json.loads((root / META).read_text())
    return PreparedData(prefix=str(root / PREFIX), tokenizer_path=str(root / "tokenizer.json"),
                        vocab_size=meta["vocab_size"], num_docs=meta["num_docs"],
                        num_tokens=meta["num_tokens"], digest=meta["digest"], cache_dir=str(root),
                        reused=reused)


def _prepare_indexed(source: IndexedSource, config: DataConfig) -> PreparedData:
    dataset = read_indexed(source.prefix)
    num_docs = len(dataset)
    if num_docs == 0:
        raise ValueError(f"corpus {source.spec!r} is empty: the indexed dataset has no documents")
    num_tokens = int(dataset.sequence_lengths.sum())
    tok_path = None
    if config.tokenizer:
        tok_path = _tokenizer_file(config.tokenizer)
    elif (source.prefix.parent / "tokenizer.json").is_file():
        tok_path = source.prefix.parent / "tokenizer.json"
    if tok_path is not None:
        vocab_size = load_tokenizer(tok_path).get_vocab_size(with_added_tokens=True)
    else:  # no tokenizer: the ids themselves bound the vocabulary
        vocab_size = 1 + max(int(dataset[i].max()) for i in range(num_docs) if len(dataset[i]))
    digest = file_digest(f"{source.prefix}.idx")[:16]
    cache = Path(config.cache_dir) / f"indexed-{digest}"
    cache.mkdir(parents=True, exist_ok=True)
    return PreparedData(prefix=str(source.prefix), tokenizer_path=str(tok_path) if tok_path else None,
                        vocab_size=vocab_size, num_docs=num_docs, num_tokens=num_tokens,
                        digest=digest, cache_dir=str(cache), reused=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m snip_megatron.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="stdlib", help="stdlib | folder | glob | file.jsonl[:field] | .bin/.idx prefix")
    p.add_argument("--out", default=DEFAULT_CACHE_DIR, help="cache folder (default %(default)s)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer", default=None, help="existing tokenizers JSON file instead of training one")
    p.add_argument("--text-field", default=None)
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--max-bytes", type=int, default=None)
    args = p.parse_args(argv)
    config = DataConfig(corpus=args.corpus, cache_dir=args.out, vocab_size=args.vocab_size,
                        tokenizer=args.tokenizer, text_field=args.text_field, max_docs=args.max_docs,
                        max_bytes=args.max_bytes)
    t0 = time.perf_counter()
    data = prepare(config, progress=True)
    print(json.dumps(asdict(data), indent=1))
    print(f"RESULT docs={data.num_docs} tokens={data.num_tokens} vocab={data.vocab_size} "
          f"reused={data.reused} seconds={time.perf_counter() - t0:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
