"""Text domains for language-model tasks: documents, their roles, and token windows cut from them.

A *domain* is a named group of documents (files, or the lines of JSONL files with a ``"text"``
field). Every document gets one role, drawn per domain with a fixed seed as in
:mod:`strategies.tasks.text`: private (owned by one node), general (the public pool), held-out
or test. Node i belongs to domain ``i % D`` and owns a contiguous, byte-balanced run of that
domain's private documents (:func:`strategies.tasks.text.assign_files`), so the shards of
different nodes are disjoint documents.

A pool of documents is tokenized into one *stream*: each document's tokens followed by the
end-of-sequence token (when the model has one), in document order; a window is ``length``
consecutive tokens of the stream at an offset drawn uniformly. A window may cross from one
document into the next of the same pool, never into another pool's (so never into another
node's documents), and documents shorter than a window still count.

The default corpus is the standard library's module families of :mod:`strategies.tasks.text`
(its file list and roles), one code domain per family.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from strategies.tasks.checks import TaskError
from strategies.tasks.text import FAMILIES, list_corpus, stdlib_root

#: Domains as the task keeps them: (name, (file patterns...)) pairs, hashable.
Domains = tuple[tuple[str, tuple[str, ...]], ...]

# Shares of each domain's documents by role; the rest is private (node-owned) data (as text.py).
ROLE_FRACTIONS = (("general", 0.2), ("heldout", 0.1), ("test", 0.1))
_GLOB_CHARS = set("*?[")


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of a corpus (its text is read when a pool is tokenized).

    Attributes:
      source: the file's path.
      line: the 1-based line of a JSONL document, 0 for a whole file.
      domain: index of its domain.
      size: bytes used (a file's size capped at the task's ``max_bytes_per_doc``).
      role: "private", "general", "heldout" or "test".
      text: a JSONL document's text (read with the file's listing); None for a file.
    """

    source: str
    line: int
    domain: int
    size: int
    role: str
    text: str | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def family(self) -> int:
        """The domain, under the name :func:`strategies.tasks.text.assign_files` reads."""
        return self.domain

    @property
    def name(self) -> str:
        """``path`` or ``path:line`` (a JSONL document)."""
        return f"{self.source}:{self.line}" if self.line else self.source


def normalize_domains(text: Any) -> Domains | None:
    """The ``text`` option as ``((domain, (patterns...)), ...)``; None keeps the default corpus.

    A string is one domain; a list is one domain per entry (an entry is a pattern or a list of
    them), named after it (:func:`domain_name`); a dict names the domains.

    Args:
      text: None, a pattern, a list of patterns (or of lists), or ``{domain: pattern(s)}``.

    Returns:
      The domains, or None.

    Raises:
      TaskError: an empty value, a non-string pattern, or two domains of one name.
    """
    if text is None:
        return None
    if isinstance(text, tuple) and all(
        isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], tuple)
        for e in text
    ):
        return text  # already normalized (a task rebuilt with dataclasses.replace)

    def patterns(value: Any, where: str) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not items:
            raise TaskError(f"{where} must be a file, a glob or a non-empty list of them, got {value!r}")
        for p in items:
            if not isinstance(p, str) or not p.strip():
                raise TaskError(f"{where}: {p!r} is not a file or glob pattern")
        return tuple(items)

    if isinstance(text, Mapping):
        if not text:
            raise TaskError("text: the table of domains is empty")
        out = tuple((str(k), patterns(v, f"text.{k}")) for k, v in text.items())
    elif isinstance(text, str):
        out = ((domain_name(text, 0), (text,)),)
    elif isinstance(text, list | tuple) and text:
        out = tuple(
            (domain_name(e if isinstance(e, str) else e[0], i), patterns(e, f"text[{i}]"))
            for i, e in enumerate(text)
        )
    else:
        raise TaskError(f"text must be a file or glob, a list of them or a table of domains, got {text!r}")
    names = [n for n, _ in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TaskError(f"text: domains {twice} are named twice; name them with a table {{name = [...]}}")
    return out


def domain_name(pattern: Any, index: int) -> str:
    """A domain's name from its first pattern: the file's stem, or the last folder before a glob.

    Args:
      pattern: the domain's first pattern.
      index: its position (the name falls back to ``domain<index>``).

    Returns:
      The name.
    """
    if not isinstance(pattern, str):
        return f"domain{index}"
    parts = [p for p in pattern.replace("\\", "/").split("/") if p not in ("", ".", "..")]
    if not parts:
        return f"domain{index}"
    if not _GLOB_CHARS & set(parts[-1]):
        return os.path.splitext(parts[-1])[0] or f"domain{index}"
    fixed = [p for p in parts if not _GLOB_CHARS & set(p)]
    literal = fixed[-1] if fixed and parts.index(fixed[-1]) < len(parts) - 1 else ""
    return literal or f"domain{index}"


def _expand(pattern: str, domain: str) -> list[str]:
    if _GLOB_CHARS & set(pattern):
        found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not found:
            raise TaskError(f"text: domain {domain!r}: the pattern {pattern!r} matches no file")
        return found
    if os.path.isdir(pattern):
        raise TaskError(f"text: {pattern!r} is a folder; give its files, e.g. '{pattern}/**/*.txt'")
    if not os.path.isfile(pattern):
        raise TaskError(f"text: domain {domain!r}: the file {pattern!r} does not exist")
    if os.path.getsize(pattern) == 0:
        raise TaskError(f"text: domain {domain!r}: the file {pattern!r} is empty")
    return [pattern]


def _jsonl_documents(path: str, domain: int, max_bytes: int) -> list[Document]:
    out = []
    with open(path, encoding="utf-8") as fh:
        for k, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"text: {path}:{k} is not JSON ({e.msg})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise TaskError(f'text: {path}:{k} has no string "text" field')
            data = text.encode("utf-8")[:max_bytes]
            if data.strip():
                out.append(Document(os.path.abspath(path), k, domain, len(data), "private", text))
    return out


def draw_roles(
    docs: list[Document], split_seed: int, num_domains: int, names: Sequence[str]
) -> list[Document]:
    """Every document's role, drawn per domain: 20% general, 10% held-out, 10% test, the rest private.

    At least one document of each shared role per domain; the draw is
    ``np.random.default_rng(split_seed)``'s permutations, domain after domain.

    Args:
      docs: the documents (roles ignored), sorted within each domain.
      split_seed: the seed.
      num_domains: D.
      names: the domain names (for the error).

    Returns:
      The documents with their roles, in the same order.

    Raises:
      TaskError: a domain with fewer than 4 documents.
    """
    rng = np.random.default_rng(split_seed)
    out = list(docs)
    for d in range(num_domains):
        idx = [j for j, doc in enumerate(docs) if doc.domain == d]
        if len(idx) < 4:
            raise TaskError(
                f"text: domain {names[d]!r} has {len(idx)} non-empty document(s); it needs at least 4 "
                "(general, held-out, test and one for its nodes): add files or JSONL lines"
            )
        order = rng.permutation(len(idx))
        start = 0
        for role, frac in ROLE_FRACTIONS:
            k = max(1, int(round(frac * len(idx))))
            for j in order[start : start + k]:
                out[idx[j]] = dataclasses.replace(docs[idx[j]], role=role)
            start += k
    return out


def list_documents(
    domains: Domains | None, *, max_bytes: int, split_seed: int, root: str | None = None
) -> tuple[tuple[str, ...], tuple[Document, ...]]:
    """The domain names and every document of the corpus with its role (no file is tokenized).

    Args:
      domains: from :func:`normalize_domains`; None: the standard library's module families
        (:data:`strategies.tasks.text.FAMILIES`, with :func:`~strategies.tasks.text.list_corpus`'s
        files and roles).
      max_bytes: a file's first this many bytes are used (a JSONL line's too).
      split_seed: the seed of the roles.
      root: the standard library's folder (default: the running interpreter's); default corpus only.

    Returns:
      ``(names, documents)``, documents sorted by (domain, path, line).

    Raises:
      TaskError: a file that does not exist or is empty, a pattern that matches nothing, a bad
        JSONL line, or a domain with too few documents.
    """
    if domains is None:
        root = stdlib_root() if root is None else root
        try:
            files = list_corpus(root=root, max_bytes_per_file=max_bytes, split_seed=split_seed)
        except ValueError as e:
            raise TaskError(f"the default corpus: {e}") from None
        stdlib = [Document(os.path.join(root, f.path), 0, f.family, f.size, f.role) for f in files]
        return tuple(name for name, _ in FAMILIES), tuple(stdlib)
    names = tuple(name for name, _ in domains)
    docs: list[Document] = []
    for d, (name, patterns) in enumerate(domains):
        paths = sorted({os.path.abspath(p) for pattern in patterns for p in _expand(pattern, name)})
        found = []
        for path in paths:
            if path.endswith(".jsonl"):
                found.extend(_jsonl_documents(path, d, max_bytes))
            else:
                size = min(os.path.getsize(path), max_bytes)
                if size > 0:
                    found.append(Document(path, 0, d, size, "private"))
        if not found:
            raise TaskError(f"text: domain {name!r}: every file of {list(patterns)} is empty")
        docs.extend(found)
    return names, tuple(draw_roles(docs, split_seed, len(names), names))


def read_document(doc: Document, max_bytes: int) -> str:
    """A document's text: a JSONL line's, or a file's first ``max_bytes`` bytes (as UTF-8).

    Invalid bytes of a file are replaced; a JSONL text cut at ``max_bytes`` drops a partial
    last character.

    Args:
      doc: the document.
      max_bytes: the most bytes of a file read.

    Returns:
      The text.
    """
    if doc.text is not None:
        return doc.text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    with open(doc.source, "rb") as fh:
        return fh.read(max_bytes).decode("utf-8", errors="replace")


def token_stream(tokenizer: Any, texts: Sequence[str], eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The texts tokenized (no special tokens) and concatenated, each followed by ``eos``.

    Args:
      tokenizer: a ``tokenizers.Tokenizer``.
      texts: the documents' texts, in order.
      eos: the end-of-sequence token id, or None (no separator).

    Returns:
      ``(stream (L,) int32, starts (len(texts),) int64)``: the tokens and where each text starts.
    """
    encoded = tokenizer.encode_batch(list(texts), add_special_tokens=False) if texts else []
    pieces, starts, at = [], [], 0
    for enc in encoded:
        ids = list(enc.ids) + ([eos] if eos is not None else [])
        starts.append(at)
        pieces.append(np.asarray(ids, np.int64))
        at += len(ids)
    stream = np.concatenate(pieces) if pieces else np.zeros((0,), np.int64)
    return stream.astype(np.int32), np.asarray(starts, np.int64)


def stream_windows(
    stream: np.ndarray, count: int, length: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` windows of ``length`` consecutive tokens of ``stream`` at uniform offsets.

    Args:
      stream: (L,) tokens, ``L >= length``.
      count: the number of windows.
      length: tokens per window (context + 1).
      rng: the draw.

    Returns:
      ``(windows (count, length) int32, offsets (count,) int64)``.
    """
    offsets = rng.integers(0, len(stream) - length + 1, size=count).astype(np.int64)
    windows = stream[offsets[:, None] + np.arange(length)[None]]
    return windows.astype(np.int32), offsets


def window_ids(offsets: np.ndarray, starts: np.ndarray, doc_index: np.ndarray) -> np.ndarray:
    """Global ids of windows: ``document << 32 | offset in it`` of each window's first token.

    Args:
      offsets: stream offsets of the windows.
      starts: where each of the stream's documents starts.
      doc_index: each of the stream's documents' index in the corpus.

    Returns:
      (count,) int64 ids (the same window of the same document has the same id in every pool).
    """
    k = np.searchsorted(starts, offsets, side="right") - 1
    return (np.asarray(doc_index, np.int64)[k] << 32) | (offsets - starts[k])
