"""Reads cut into batches of a fixed size, every item exactly once, with a position that
survives a restart: the one algorithm under text packing (text/packing.py: tokens) and tabular
row windows (tabular/window.py: rows).

Each read of the reader becomes a `Read` (a packed piece of documents, a shuffled window of
rows) that knows the reader's state before it. Batches are cut off the front of the reads,
a batch spanning two reads where one runs out; the caller turns each batch's spans into its
own output.

    cutter = Cutter(size)
    for read, after in reads:            # after: the reader's state after this read
        cutter.add(read, after)
        while cutter.ready():
            spans, skips = cutter.take()  # [(read, lo, hi), ...]: the next `size` items
            emit(spans, skips, cutter.position())
    while cutter.available or cutter.pending_skips():
        emit(*cutter.take(), cutter.position())   # the epoch's last, short batch

The position after a batch is (the reader's state before the first read not used up, items of
that read already handed out): a new reader started from that state re-reads that read, drops
that many items and continues exactly where the batch left off. A few numbers, however large
the reads. Skips met during a read go out with the first batch that reaches it.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Generic, Protocol, TypeVar


class Read(Protocol):
    """What the cutter needs of a read: the reader's state before it, its skips, and how far
    it is used up."""

    before: dict[str, Any] | None  # None: the epoch's start
    skips: list[dict[str, Any]]
    offset: int  # items already handed out
    reported: bool  # its skips went out with a batch

    @property
    def left(self) -> int: ...


R = TypeVar("R", bound=Read)


class Cutter(Generic[R]):
    """Reads in, spans of `size` items out; `position()` after each batch."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.reads: deque[R] = deque()
        self.available = 0
        self.after: dict[str, Any] | None = None  # the reader's state after the last read

    def add(self, read: R, after: dict[str, Any]) -> None:
        self.reads.append(read)
        self.available += read.left
        self.after = after

    def ready(self) -> bool:
        return self.available >= self.size

    def take(self, n: int | None = None) -> tuple[list[tuple[R, int, int]],
                                                   list[dict[str, Any]]]:
        """The next `n` items (default: a batch; fewer when fewer are left) as spans (read,
        lo, hi), and the skips of every read reached so far."""
        want = min(self.size if n is None else n, self.available)
        spans: list[tuple[R, int, int]] = []
        skips: list[dict[str, Any]] = []
        while self.reads and (want > 0 or not self.reads[0].left):
            read = self.reads[0]
            if not read.reported:
                skips.extend(read.skips)
                read.reported = True
            got = min(want, read.left)
            if got:
                spans.append((read, read.offset, read.offset + got))
                read.offset += got
                want -= got
                self.available -= got
            if not read.left:
                self.reads.popleft()
        return spans, skips

    def pending_skips(self) -> bool:
        return any(not r.reported and r.skips for r in self.reads)

    def position(self) -> tuple[dict[str, Any] | None, int]:
        """(reader state to restart from, items of its first read to drop)."""
        if self.reads:
            return self.reads[0].before, self.reads[0].offset
        return self.after, 0
