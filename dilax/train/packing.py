"""Packed training rows (``python -m dilax.train --pack``): documents, their packing into
``seq_len`` rows with document ids, and the batches of a packed run.

- Documents (:func:`read_documents`): the files of a directory (sorted by name), or one text
  file split on separator lines (a line that is exactly ``doc_separator``, default
  :data:`DEFAULT_DOC_SEPARATOR`; the separator lines are dropped).
- Packing (:func:`pack_documents`): greedy, in order ("next fit"). A document goes into the
  current row if it fits in what is left of it; otherwise the row is closed (its rest is
  padding, past the row's valid length) and the document starts a new row. A document longer
  than a row is cut into pieces of ``seq_len`` tokens (the last piece holds the rest), each
  packed as a document of its own: attention and the loss never cross a piece boundary.
- Rows: ``tokens (R, seq_len)``, ``segment_ids (R, seq_len)`` (the pieces of a row numbered
  ``0, 1, ...``, the padding one more id) and ``lengths (R,)`` valid tokens. The model sees
  ``segment_ids`` (every document as if alone, positions from 0) and ``lengths``; the targets
  are the next tokens of the row, and :func:`dilax.train.lm_loss` drops the ones that cross a
  document (or piece) boundary: a document of ``L`` tokens gives ``L - 1`` targets.
- Batches are pure functions of ``(seed, step)`` as in unpacked runs, so resume is exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from pathlib import Path

import numpy as np

from dilax.train.config import DEFAULT_DOC_SEPARATOR, read_text_file

__all__ = ["DEFAULT_DOC_SEPARATOR", "PackedRows", "check_doc_separator", "documents_sha256",
           "pack_documents", "packed_batch", "packed_eval_batches", "read_documents",
           "split_documents", "split_text"]


def check_doc_separator(separator: str) -> str:
    """``separator``: a non-empty line (no line break)."""
    if not isinstance(separator, str) or not separator or any(c in separator for c in "\r\n"):
        raise ValueError(f"doc_separator (--doc-separator) must be a non-empty line without "
                         f"line breaks, got {separator!r}")
    return separator


def split_text(text: str, separator: str = DEFAULT_DOC_SEPARATOR) -> list[str]:
    """The documents of ``text``: the runs of lines between lines that are exactly
    ``separator`` (line endings aside). Lines keep their endings; separator lines are dropped
    and so are documents that hold only whitespace."""
    separator = check_doc_separator(separator)
    docs, current = [], []
    for line in text.splitlines(keepends=True):
        if line.rstrip("\r\n") == separator:
            docs.append("".join(current))
            current = []
        else:
            current.append(line)
    docs.append("".join(current))
    return [d for d in docs if d.strip()]


def read_documents(path: str | None, separator: str = DEFAULT_DOC_SEPARATOR,
                   flag: str = "--data") -> list[str]:
    """The documents at ``path``: every regular, non-hidden, non-blank file of a directory
    (sorted by name, not recursive; each file one document), or a text file split by
    :func:`split_text` (``None``: the shipped corpus). Raises ``ValueError`` naming ``flag``
    when there is no document."""
    if path is None:
        from dilax.data import load_corpus

        docs = split_text(load_corpus(), separator)
    elif Path(path).is_dir():
        files = sorted(p for p in Path(path).iterdir()
                       if p.is_file() and not p.name.startswith("."))
        # blank files are empty documents (skipped); others must be UTF-8 text
        docs = [read_text_file(p, flag) for p in files if p.read_bytes().strip()]
    else:
        docs = split_text(read_text_file(path, flag), separator)
    if not docs:
        raise ValueError(f"{flag} {path}: no documents (an empty directory, or only separator "
                         "lines and whitespace)")
    if len(docs) == 1:  # packing one document is plain training: say why, it is rarely meant
        where = ("a directory with one file" if path is not None and Path(path).is_dir() else
                 f"no line that is exactly {separator!r}")
        warnings.warn(f"{flag} {path or '(the shipped corpus)'}: --pack found 1 document "
                      f"({where}); every row is then one document. Separate documents with a "
                      f"line {separator!r} (--doc-separator), or give a directory of files",
                      UserWarning, stacklevel=2)
    return docs


def documents_sha256(docs: list[str]) -> str:
    """SHA-256 of the documents and their boundaries (a checkpoint records it)."""
    h = hashlib.sha256(b"dilax-packed-documents\0")
    for d in docs:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def split_documents(docs: list[np.ndarray], val_fraction: float = 0.1
                    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(train, eval)`` documents: the cut of :func:`dilax.train.split_corpus` on the
    concatenated tokens (the first ``1 - val_fraction``); a document across it is cut in two."""
    total = sum(len(d) for d in docs)
    cut = int(total * (1.0 - val_fraction))
    train, held, seen = [], [], 0
    for d in docs:
        k = min(max(cut - seen, 0), len(d))
        if k:
            train.append(d[:k])
        if k < len(d):
            held.append(d[k:])
        seen += len(d)
    return train, held


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Packed rows: ``tokens``, ``segment_ids`` int32 ``(R, seq_len)``, ``lengths`` int32
    ``(R,)`` (tokens past a row's length are padding: token 0, their own id)."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)


def pack_documents(docs: list[np.ndarray], seq_len: int) -> PackedRows:
    """Packs token documents greedily into rows of ``seq_len`` (see the module docstring:
    next fit, in order; longer documents cut into ``seq_len`` pieces)."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    pieces = [d[i:i + seq_len] for d in docs for i in range(0, len(d), seq_len)]
    rows: list[list[np.ndarray]] = []
    room = 0
    for p in pieces:
        if not len(p):
            continue
        if len(p) > room:
            rows.append([])
            room = seq_len
        rows[-1].append(p)
        room -= len(p)
    tokens = np.zeros((len(rows), seq_len), np.int32)
    ids = np.zeros((len(rows), seq_len), np.int32)
    lengths = np.zeros((len(rows),), np.int32)
    for r, row in enumerate(rows):
        start = 0
        for i, p in enumerate(row):
            tokens[r, start:start + len(p)] = p
            ids[r, start:start + len(p)] = i
            start += len(p)
        ids[r, start:] = len(row)  # padding: not part of the last document
        lengths[r] = start
    return PackedRows(tokens, ids, lengths)


def _batch(rows: PackedRows, idx: np.ndarray):
    x = rows.tokens[idx]
    y = np.zeros_like(x)  # the next token in the row (the last one has none: dropped)
    y[:, :-1] = x[:, 1:]
    return x, y, rows.segment_ids[idx], rows.lengths[idx]


def packed_batch(rows: PackedRows, seed: int, step: int, batch_size: int):
    """``(x, y, segment_ids, lengths)`` of step ``step``: rows drawn from
    ``default_rng([seed, step])`` (a pure function of ``(seed, step)``)."""
    idx = np.random.default_rng([seed, step]).integers(0, len(rows), batch_size)
    return _batch(rows, idx)


def packed_eval_batches(rows: PackedRows, num_batches: int, batch_size: int) -> list:
    """Fixed, evenly spaced rows of the held-out packing, ``num_batches`` batches."""
    idx = np.linspace(0, len(rows) - 1, num_batches * batch_size).astype(np.int64)
    return [_batch(rows, i) for i in idx.reshape(num_batches, batch_size)]
