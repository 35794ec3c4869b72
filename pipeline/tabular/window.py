"""Rows of blocks into batches of `batch_size` rows, every row exactly once, shuffled within
windows, with a position that survives a restart (the idea of pipeline/text/packing.py).

Each read of the reader (a few whole blocks, about `shuffle_buffer` rows when training)
becomes a `Window`: its blocks' rows decoded, hashed and transformed, then permuted by a
generator drawn from (seed, epoch, the key of the window's first block), so the same read
always gives the same order. Batches are cut off the front of the windows, a batch spanning
two windows where one runs out.

The position after a batch is (the reader's state before the first window not used up, rows
of that window already handed out): a new reader started from that state re-reads that
window, permutes it the same way, drops that many rows and continues exactly where the batch
left off. A few numbers, however many rows the windows hold.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


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


class Windows:
    """Windows in, batches of `size` rows out; `position()` after each batch."""

    def __init__(self, size: int, dense: int, fields: int) -> None:
        self.size, self.dense, self.fields = size, dense, fields
        self.windows: deque[Window] = deque()
        self.available = 0
        self.after: dict[str, Any] | None = None  # the reader's state after the last window

    def add(self, window: Window, after: dict[str, Any]) -> None:
        self.windows.append(window)
        self.available += window.left
        self.after = after

    def ready(self) -> bool:
        return self.available >= self.size

    def take(self) -> Cut:
        """The next batch (fewer rows when fewer are left), with the skips of every window
        reached so far."""
        want = min(self.size, self.available)
        parts: list[tuple[Window, int, int]] = []
        skips: list[dict[str, Any]] = []
        while self.windows and (want > 0 or not self.windows[0].left):
            w = self.windows[0]
            if not w.reported:
                skips.extend(w.skips)
                w.reported = True
            got = min(want, w.left)
            if got:
                parts.append((w, w.offset, w.offset + got))
                w.offset += got
                want -= got
                self.available -= got
            if not w.left:
                self.windows.popleft()
        return self._cut(parts, skips)

    def _cut(self, parts: list[tuple[Window, int, int]], skips: list[dict[str, Any]]) -> Cut:
        if not parts:
            return Cut(np.zeros((0, self.dense), np.float32),
                       np.zeros((0, self.fields), np.int64), np.zeros(0, np.float32), [],
                       skips)
        keys = []
        for w, lo, hi in parts:
            names = w.blocks
            keys += [f"{names[b]}:{r}" for b, r in zip(w.block_of[lo:hi].tolist(),
                                                        w.row_of[lo:hi].tolist(), strict=True)]
        if len(parts) == 1:
            w, lo, hi = parts[0]
            return Cut(w.dense[lo:hi], w.sparse[lo:hi], w.label[lo:hi], keys, skips)
        return Cut(np.concatenate([w.dense[lo:hi] for w, lo, hi in parts]),
                   np.concatenate([w.sparse[lo:hi] for w, lo, hi in parts]),
                   np.concatenate([w.label[lo:hi] for w, lo, hi in parts]), keys, skips)

    def pending_skips(self) -> bool:
        return any(not w.reported and w.skips for w in self.windows)

    def position(self) -> tuple[dict[str, Any] | None, int]:
        """(reader state to restart from, rows of its first read to drop)."""
        if self.windows:
            return self.windows[0].before, self.windows[0].offset
        return self.after, 0
