"""Rows of blocks into batches of `batch_size` rows, every row exactly once, shuffled within
windows, with a position that survives a restart (loading/cutting.py's Cutter, the algorithm
text packing shares).

Each read of the reader (a few whole blocks, about `shuffle_buffer` rows when training)
becomes a `Window`: its blocks' rows decoded, hashed and transformed, then permuted by a
generator drawn from (seed, epoch, the key of the window's first block), so the same read
always gives the same order. Batches are cut off the front of the windows, a batch spanning
two windows where one runs out. A resume re-reads the window its position names, permutes it
the same way and drops the rows already handed out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardflow.loading.cutting import Cutter


@dataclass
class Window:
    """The rows of one read, ready for the model: dense float32 (n, D), sparse int64 (n, F),
    label float32 (n,); row i came from block `blocks[block_of[i]]`, its row `row_of[i]`."""

    before: dict[str, Any] | None  # the reader's state before this read (None: epoch start)
    dense: np.ndarray
    sparse: np.ndarray
    label: np.ndarray
    blocks: list[str]  # block keys
    block_of: np.ndarray  # int32 (n,)
    row_of: np.ndarray  # int32 (n,)
    skips: list[dict[str, Any]] = field(default_factory=list)  # met during this read
    offset: int = 0  # rows already handed out
    reported: bool = False  # its skips went out with a batch

    @property
    def left(self) -> int:
        return len(self.label) - self.offset

    def permute(self, seed: int, epoch: int) -> None:
        """Shuffle the rows, from (seed, epoch, first block key) alone."""
        if not self.blocks:
            return
        order = np.random.default_rng(window_seed(seed, epoch, self.blocks[0])) \
            .permutation(len(self.label))
        for name in ("dense", "sparse", "label", "block_of", "row_of"):
            setattr(self, name, getattr(self, name)[order])


def window_seed(seed: int, epoch: int, first_key: str) -> int:
    """A 64-bit generator seed for a window (blake2b: the same in every process)."""
    text = f"tabular-window/{seed}/{epoch}/{first_key}".encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


@dataclass
class Cut:
    """One batch's rows, their keys, and the skips to report with it."""

    dense: np.ndarray
    sparse: np.ndarray
    label: np.ndarray
    keys: list[str]
    skips: list[dict[str, Any]]


# The tabular loader's cutter: Windows in, batches of `size` rows out (loading/cutting.py).
Windows = Cutter


def rows_of(spans: list[tuple[Window, int, int]], skips: list[dict[str, Any]], dense: int,
            fields: int) -> Cut:
    """One batch's rows, from a Windows cutter's spans, with their keys (block:row)."""
    if not spans:
        return Cut(np.zeros((0, dense), np.float32), np.zeros((0, fields), np.int64),
                   np.zeros(0, np.float32), [], skips)
    keys = [f"{w.blocks[b]}:{r}" for w, lo, hi in spans
            for b, r in zip(w.block_of[lo:hi].tolist(), w.row_of[lo:hi].tolist(), strict=True)]
    if len(spans) == 1:
        w, lo, hi = spans[0]
        return Cut(w.dense[lo:hi], w.sparse[lo:hi], w.label[lo:hi], keys, skips)
    return Cut(np.concatenate([w.dense[lo:hi] for w, lo, hi in spans]),
               np.concatenate([w.sparse[lo:hi] for w, lo, hi in spans]),
               np.concatenate([w.label[lo:hi] for w, lo, hi in spans]), keys, skips)
