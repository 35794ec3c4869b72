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
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")
CHUNK = 8


class WorkerError(RuntimeError):
    """A worker process hung past the timeout or died (killed, out of memory)."""


def _run_chunk(fn: Callable[[T, Any], R], chunk: list[T], extra: Any) -> list[R]:
    return [fn(item, extra) for item in chunk]


def ordered_map(fn: Callable[[T, Any], R], items: Iterable[T], extra: Any, workers: int,
                *, chunk: int = CHUNK, window: int | None = None,
                timeout_s: float | None = None, describe: Callable[[T], str] = str
                ) -> Generator[R, None, None]:
    """`fn(item, extra)` for each item, in order; inline when workers == 1.

    With worker processes, a chunk whose result has not come `timeout_s` after it became the
    oldest in flight is declared hung, and a dead worker is reported: both as WorkerError
    naming the inputs (by `describe`), with the workers stopped. Inline work has no timeout."""
    if workers <= 1:
        yield from (fn(item, extra) for item in items)
        return
    window = window or 4 * workers
    source = iter(items)
    # forkserver: workers do not inherit the parent's threads (progress bars, loggers).
    ctx = multiprocessing.get_context("forkserver")
    pool = ProcessPoolExecutor(workers, mp_context=ctx)
    pending: deque[tuple[Future[list[R]], list[T]]] = deque()
    failed = False
    try:
        while True:
            while len(pending) < window and (batch := list(islice(source, chunk))):
                pending.append((pool.submit(_run_chunk, fn, batch, extra), batch))
            if not pending:
                return
            future, batch = pending.popleft()
            try:
                results = future.result(timeout=timeout_s)
            except (FutureTimeout, BrokenProcessPool) as exc:
                failed = True
                raise _worker_error(exc, batch, timeout_s, describe) from None
            yield from results
    finally:
        if failed:  # a hung worker would never let shutdown(wait=True) return
            _terminate(pool)
        # On an error or an early close, drop queued work instead of finishing it.
        pool.shutdown(wait=not failed, cancel_futures=True)


def _worker_error(exc: Exception, batch: list[T], timeout_s: float | None,
                  describe: Callable[[T], str]) -> WorkerError:
    names = ", ".join(describe(item) for item in batch[:3])
    more = f" and {len(batch) - 3} more" if len(batch) > 3 else ""
    if isinstance(exc, BrokenProcessPool):
        return WorkerError(f"a worker process died (killed, or out of memory) with these "
                           f"inputs in flight: {names}{more}")
    return WorkerError(f"no result for {timeout_s:.0f} s from the worker on {names}{more}: it "
                       "is hung (a stalled read or decode); raise the worker timeout if such "
                       "inputs legitimately take that long")


def _terminate(pool: ProcessPoolExecutor) -> None:
    # ProcessPoolExecutor has no public way to stop a busy worker before Python 3.14.
    for proc in list(getattr(pool, "_processes", {}).values()):
        proc.terminate()
