"""Corpus sources: where the documents come from, read in a fixed order, one document at a time.

A corpus spec is one string, so the CLI, configs and tests all name corpora the same way:
- ``stdlib``: the running interpreter's standard library sources (no download, on every machine);
- a folder (every regular file under it) or a glob (``data/*.txt``, ``**`` allowed);
- ``file.jsonl`` or ``file.jsonl:field``: one JSON object per line, text in ``field`` (default ``text``);
- a Megatron indexed-dataset prefix (``path/name`` with ``path/name.bin`` and ``path/name.idx``):
  already tokenized, used as is.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

STDLIB = "stdlib"

# Folders under the stdlib path that hold third-party packages, not the standard library.
_NOT_STDLIB = ("site-packages", "dist-packages", "__pycache__")


@dataclass(frozen=True, kw_only=True)
class Document:
    """One document of a corpus."""

    name: str
    """Where it came from (relative path, or file:line), for logs and errors."""
    text: str
    """Its text."""


@dataclass(frozen=True, kw_only=True)
class TextSource:
    """Documents from text files, a JSONL file or the standard library, in a fixed order."""

    kind: str
    """"stdlib", "files" or "jsonl"."""
    spec: str
    """The corpus spec it was parsed from."""
    paths: tuple[Path, ...]
    """Files to read, in reading order."""
    root: Path | None = None
    """Folder the document names are relative to."""
    text_field: str = "text"
    """JSONL only: the key that holds the text."""
    max_docs: int | None = None
    """Read at most this many documents (a deterministic prefix of the reading order)."""
    max_bytes: int | None = None
    """UTF-8 size cap: a document that would overflow it is skipped, and reading stops at the
    first such document once 90% of the cap is used (one large file cannot end a capped corpus
    early, and the documents Megatron holds out at the end are ordinary ones)."""

    def describe(self) -> dict:
        """What identifies this corpus apart from its contents (goes into the cache key)."""
        return {"kind": self.kind, "text_field": self.text_field if self.kind == "jsonl" else None,
                "max_docs": self.max_docs, "max_bytes": self.max_bytes}

    def documents(self) -> Iterator[Document]:
        """Documents in reading order, honouring max_docs and max_bytes."""
        total_docs = total_bytes = 0
        for doc in self._all_documents():
            size = len(doc.text.encode("utf-8"))
            if self.max_docs is not None and total_docs >= self.max_docs:
                return
            if self.max_bytes is not None and total_bytes + size > self.max_bytes:
                if total_bytes >= 0.9 * self.max_bytes:
                    return
                continue
            total_docs += 1
            total_bytes += size
            yield doc

    def _all_documents(self) -> Iterator[Document]:
        if self.kind == "jsonl":
            yield from _jsonl_documents(self.paths[0], self.text_field)
            return
        for path in self.paths:
            # errors="replace": a few stdlib test files are deliberately not UTF-8; replacing keeps
            # the reading deterministic instead of dropping files depending on the locale.
            text = path.read_bytes().decode("utf-8", errors="replace")
            if not text.strip():
                continue
            name = path.relative_to(self.root).as_posix() if self.root else str(path)
            yield Document(name=name, text=text)


@dataclass(frozen=True, kw_only=True)
class IndexedSource:
    """An existing Megatron indexed dataset (``prefix.bin`` + ``prefix.idx``), already tokenized."""

    spec: str
    """The corpus spec it was parsed from."""
    prefix: Path
    """Path prefix of the .bin/.idx pair."""
    kind: str = "indexed"
    """Always "indexed"."""


def stdlib_files() -> tuple[Path, tuple[Path, ...]]:
    """(stdlib root, every .py file under it), site-packages excluded.

    The order is fixed but not alphabetical: sorted by the SHA-256 of each relative path, so that
    any capped prefix samples the whole library (an alphabetical 400 kB is a dozen `_*.py` files)
    and the validation documents, which Megatron takes from the end, are no different in kind.
    """
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _NOT_STDLIB]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return root, tuple(sorted(files, key=lambda p: _path_hash(p.relative_to(root).as_posix())))


def _path_hash(relative: str) -> str:
    return hashlib.sha256(relative.encode("utf-8")).hexdigest()


def parse_corpus(spec: str, *, text_field: str | None = None, max_docs: int | None = None,
                 max_bytes: int | None = None) -> TextSource | IndexedSource:
    """The source a corpus spec names; raises ValueError for paths that do not exist or hold nothing."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"corpus spec must be a non-empty string, got {spec!r}")
    for name, v in (("max_docs", max_docs), ("max_bytes", max_bytes)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
    caps = {"max_docs": max_docs, "max_bytes": max_bytes}

    if spec == STDLIB:
        root, files = stdlib_files()
        if not files:
            raise ValueError(f"corpus 'stdlib': no .py files found under {root}")
        return TextSource(kind="stdlib", spec=spec, paths=files, root=root, **caps)

    path_part, field = spec, text_field
    if ".jsonl:" in spec:
        path_part, _, field = spec.rpartition(":")
    if path_part.endswith(".jsonl"):
        path = Path(path_part)
        if not path.is_file():
            raise ValueError(f"corpus {spec!r}: JSONL file {path} does not exist")
        return TextSource(kind="jsonl", spec=spec, paths=(path,), text_field=field or "text", **caps)

    prefix = Path(spec[:-4] if spec.endswith((".bin", ".idx")) else spec)
    if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
        return IndexedSource(spec=spec, prefix=prefix)

    path = Path(spec)
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and not _hidden(p, path)),
                       key=lambda p: p.relative_to(path).as_posix())
        root = path
    elif glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        root = None
    elif path.is_file():
        files, root = [path], None
    else:
        raise ValueError(f"corpus {spec!r} does not exist: expected 'stdlib', a folder, a glob, "
                         f"a .jsonl file or a Megatron prefix with .bin/.idx files")
    if not files:
        raise ValueError(f"corpus {spec!r} is empty: no files found")
    return TextSource(kind="files", spec=spec, paths=tuple(files), root=root, **caps)


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _jsonl_documents(path: Path, field: str) -> Iterator[Document]:
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"corpus {path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise ValueError(f"corpus {path}:{lineno}: no text field {field!r} "
                                 f"(pass 'file.jsonl:<field>' to choose another)")
            text = record[field]
            if not isinstance(text, str):
                raise ValueError(f"corpus {path}:{lineno}: field {field!r} is not a string")
            if text.strip():
                yield Document(name=f"{path.name}:{lineno}", text=text)
