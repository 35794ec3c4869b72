"""Packing documents into rows of `seq_len` tokens, every token exactly once, with a position
that survives a restart.

The reader hands over documents a read at a time; each read becomes a `Piece`: its documents'
tokens back to back, each document followed by the separator (`join`, or a tokenizer's own
`encode_packed`). The packer (loading/cutting.py's Cutter, the algorithm tabular row windows
share) cuts batches of `rows x seq_len` tokens off the front of the pieces, so a document may
continue from one row (or batch) into the next and no row is padded, except in the epoch's
last batch. Its position after a batch is a few numbers, whatever the length of the
documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardflow.loading.cutting import Cutter


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


# The text loader's cutter: Pieces in, batches of `size` tokens out (loading/cutting.py).
Packer = Cutter


def tokens_of(spans: list[tuple[Piece, int, int]], skips: list[dict[str, str]]) -> Cut:
    """One batch's tokens, from a Packer's spans, with the keys they came from."""
    parts = [piece.tokens[lo:hi] for piece, lo, hi in spans]
    keys = [key for piece, lo, hi in spans for key in piece.keys_between(lo, hi)]
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return Cut(tokens, _unique(keys), skips)


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
