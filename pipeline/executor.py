"""An ordered, bounded parallel map over worker processes.

Results come back in input order (so shards are deterministic whatever the scheduling) and at
most `window` chunks are in flight, so a long or endless input never piles up in memory
(`multiprocessing.Pool.imap` would read its whole input ahead).
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import islice
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")
CHUNK = 8


def _run_chunk(fn: Callable[[T, Any], R], chunk: list[T], extra: Any) -> list[R]:
    return [fn(item, extra) for item in chunk]


def ordered_map(fn: Callable[[T, Any], R], items: Iterable[T], extra: Any, workers: int,
                *, chunk: int = CHUNK, window: int | None = None) -> Generator[R, None, None]:
    """`fn(item, extra)` for each item, in order; inline when workers == 1."""
    if workers <= 1:
        yield from (fn(item, extra) for item in items)
        return
    window = window or 4 * workers
    source = iter(items)
    # forkserver: workers do not inherit the parent's threads (progress bars, loggers).
    ctx = multiprocessing.get_context("forkserver")
    pool = ProcessPoolExecutor(workers, mp_context=ctx)
    pending: deque[Future[list[R]]] = deque()
    try:
        while True:
            while len(pending) < window and (batch := list(islice(source, chunk))):
                pending.append(pool.submit(_run_chunk, fn, batch, extra))
            if not pending:
                return
            yield from pending.popleft().result()
    finally:
        # On an error or an early close, drop queued work instead of finishing it.
        pool.shutdown(wait=True, cancel_futures=True)
