"""Packing documents into rows of `seq_len` tokens, every token exactly once, with a position
that survives a restart.

The reader hands over documents a read at a time; each read becomes a `Piece`: its documents'
tokens back to back, each document followed by the separator (`join`, or a tokenizer's own
`encode_packed`). The packer cuts batches of
`rows x seq_len` tokens off the front of the pieces, so a document may continue from one row
(or batch) into the next and no row is padded, except in the epoch's last batch.

The position after a batch is (the reader's state before the first piece not yet used up,
tokens of that piece already emitted): a new reader started from that state re-reads that
piece, drops that many tokens, and continues exactly where the batch left off. It is a few
numbers, whatever the length of the documents.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Piece:
    """The tokens of one read: documents back to back, each ended by the separator."""

    before: dict[str, Any] | None  # the reader's state before this read (None: epoch start)
    tokens: np.ndarray  # int32 (T,)
    starts: np.ndarray  # int64 (D,): where each document starts in `tokens`
    keys: list[str]  # each document's key
    skips: list[dict[str, str]] = field(default_factory=list)  # met during this read
    offset: int = 0  # tokens already emitted
    reported: bool = False  # its skips went out with a batch
    # Each document's shard URL, and (URL, key) of every sample of the read, documents or
    # not: what a position in this read has used up (pipeline/text/elastic.py).
    urls: list[str] = field(default_factory=list)
    read: list[tuple[str, str]] = field(default_factory=list)

    @property
    def left(self) -> int:
        return len(self.tokens) - self.offset

    def keys_between(self, lo: int, hi: int) -> list[str]:
        """Keys of the documents with tokens in [lo, hi): a run of them, as every document
        holds at least its separator (ends and starts both ascend)."""
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1  # the one holding lo
        last = int(np.searchsorted(self.starts, hi, side="left"))  # the first starting at hi
        return self.keys[max(first, 0): last]


@dataclass
class Cut:
    """One batch's tokens, the documents they came from and the skips to report with it."""

    tokens: np.ndarray
    keys: list[str]
    skips: list[dict[str, str]]


class Packer:
    """Pieces in, batches of `size` tokens out; `position()` after each batch."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pieces: deque[Piece] = deque()
        self.available = 0
        self.after: dict[str, Any] | None = None  # the reader's state after the last piece

    def add(self, piece: Piece, after: dict[str, Any]) -> None:
        self.pieces.append(piece)
        self.available += piece.left
        self.after = after

    def ready(self) -> bool:
        return self.available >= self.size

    def take(self, n: int | None = None) -> Cut:
        """The next `n` tokens (default: a whole batch; fewer when fewer are left), with the
        keys they came from and the skips of every piece reached so far."""
        want = min(self.size if n is None else n, self.available)
        parts, keys, skips = [], [], []
        while self.pieces and (want > 0 or not self.pieces[0].left):
            piece = self.pieces[0]
            if not piece.reported:
                skips.extend(piece.skips)
                piece.reported = True
            got = min(want, piece.left)
            if got:
                parts.append(piece.tokens[piece.offset: piece.offset + got])
                keys.extend(piece.keys_between(piece.offset, piece.offset + got))
                piece.offset += got
                want -= got
                self.available -= got
            if not piece.left:
                self.pieces.popleft()
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return Cut(tokens, _unique(keys), skips)

    def pending_skips(self) -> bool:
        return any(not p.reported and p.skips for p in self.pieces)

    def position(self) -> tuple[dict[str, Any] | None, int]:
        """(reader state to restart from, tokens of its first read to drop)."""
        if self.pieces:
            return self.pieces[0].before, self.pieces[0].offset
        return self.after, 0


def _unique(keys: list[str]) -> list[str]:
    # A document split across two pieces cannot happen (a piece holds whole documents), but
    # one spanning two rows of the same batch is listed once.
    return list(dict.fromkeys(keys))


def join(docs: list[np.ndarray], sep_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents back to back, each followed by the separator: (tokens int32, where each
    document starts int64), the form of a Piece."""
    lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    sep = np.array([sep_id], dtype=np.int32)
    parts = [part for doc in docs for part in (doc, sep)]
    tokens = np.concatenate(parts).astype(np.int32, copy=False) if parts \
        else np.zeros(0, np.int32)
    return tokens, starts


def documents(tokens: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
    """Each document's tokens without its separator, from `join`'s form."""
    if not len(starts):
        return []
    ends = np.append(starts[1:], len(tokens)) - 1
    return [tokens[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


def rows(tokens: np.ndarray, seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask), both int64 (ceil(T / seq_len), seq_len); the tail is padded."""
    count = -(-len(tokens) // seq_len)
    if len(tokens) == count * seq_len:  # full rows, every batch but an epoch's last
        return (tokens.astype(np.int64).reshape(count, seq_len),
                np.ones((count, seq_len), dtype=np.int64))
    ids = np.full(count * seq_len, pad_id, dtype=np.int64)
    ids[: len(tokens)] = tokens
    mask = np.zeros(count * seq_len, dtype=np.int64)
    mask[: len(tokens)] = 1
    return ids.reshape(count, seq_len), mask.reshape(count, seq_len)


def truncated_rows(docs: list[np.ndarray], seq_len: int, pad_id: int, sep_id: int
                   ) -> tuple[np.ndarray, np.ndarray, int]:
    """One row per document (for packing=False): its first tokens, the separator if it fits,
    padding after. Returns (ids, attention mask, tokens cut off)."""
    ids = np.full((len(docs), seq_len), pad_id, dtype=np.int64)
    mask = np.zeros((len(docs), seq_len), dtype=np.int64)
    cut = 0
    for i, doc in enumerate(docs):
        row = np.append(doc, sep_id)[:seq_len]
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
        cut += max(len(doc) + 1 - seq_len, 0)
    return ids, mask, cut
