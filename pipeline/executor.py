"""An ordered, bounded parallel map over worker processes.

Results come back in input order (so shards are deterministic whatever the scheduling) and at
most `window` chunks are in flight, so a long or endless input never piles up in memory
(`multiprocessing.Pool.imap` would read its whole input ahead).

Helping (`helping=True`): the calling process is one of the `workers` (workers - 1 processes
beside it): it takes the next chunk itself whenever the oldest is not back yet, instead of
waiting, with `own_extra` when given (what suits work done in this process). A consumer
with work of its own per result (a conversion writes and hashes every sample) then shares
the cores with the workers rather than competing with one more process.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
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
                timeout_s: float | None = None, describe: Callable[[T], str] = str,
                helping: bool = False, own_extra: Any = None) -> Generator[R, None, None]:
    """`fn(item, extra)` for each item, in order; inline when workers == 1.

    With worker processes, a chunk whose result has not come `timeout_s` after it became the
    oldest in flight is declared hung, and a dead worker is reported: both as WorkerError
    naming the inputs (by `describe`). Unless the map runs to its end, the workers are
    terminated, not waited for (one may be hung). Inline work has no timeout. `helping` and
    `own_extra`: see the module docstring."""
    procs = workers - 1 if helping else workers
    if workers <= 1 or procs < 1:
        yield from (fn(item, extra) for item in items)
        return
    if timeout_s is not None and timeout_s >= threading.TIMEOUT_MAX:
        timeout_s = None  # beyond what a wait can take: no limit
    window = window or 4 * workers
    source = iter(items)
    pool = _pool(fn, procs)
    pending: deque[tuple[Future[list[R]], list[T]]] = deque()
    finished = False
    hide = _main_is_no_file()
    oldest: tuple[Future[list[R]] | None, float] = (None, 0.0)  # and since when
    try:
        while True:
            try:
                while len(pending) < window and (batch := list(islice(source, chunk))):
                    # A submit may start a worker (one a submit, up to `procs`).
                    with _main_hidden() if hide else contextlib.nullcontext():
                        future = pool.submit(_run_chunk, fn, batch, extra)
                    pending.append((future, batch))
                if not pending:
                    finished = True
                    return
                head = pending[0][0]
                if head is not oldest[0]:
                    oldest = (head, time.monotonic())
                # Helping: the next chunk done here, at the end of the line (in order), while
                # the oldest is not back; at most a window ahead, so a hung worker cannot
                # make this process read the rest of the input into memory.
                if helping and not head.done() and len(pending) < 2 * window \
                        and (batch := list(islice(source, chunk))):
                    mine = extra if own_extra is None else own_extra
                    pending.append((_done(_run_chunk(fn, batch, mine)), batch))
                    continue
                results = head.result(timeout=_left(timeout_s, oldest[1]))
            except FutureTimeout:
                raise _hung(pending[0][1], timeout_s, describe) from None
            except BrokenProcessPool:
                raise _died([item for _, batch in pending for item in batch], describe) \
                    from None
            pending.popleft()
            yield from results
    finally:
        if not finished:  # an error, a hung or dead worker, or an early close
            _terminate(pool)
        pool.shutdown(wait=finished, cancel_futures=True)


def _left(timeout_s: float | None, since: float) -> float | None:
    """What is left of `timeout_s` counted from `since` (time.monotonic)."""
    return None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - since))


def _pool(fn: Callable[..., Any], procs: int) -> ProcessPoolExecutor:
    # forkserver: workers do not inherit the parent's threads (progress bars, loggers).
    ctx = multiprocessing.get_context("forkserver")
    # The main script and the worker function's module are imported once, in the fork server
    # (the first map's), not in each worker: a conversion's imports took a quarter of a
    # second of CPU per worker.
    ctx.set_forkserver_preload(["__main__", fn.__module__])
    pool = ProcessPoolExecutor(procs, mp_context=ctx)
    _widen_result_pipe(pool)
    return pool


def _done(value: R) -> Future[R]:
    """A future already holding `value` (a chunk the consumer converted itself)."""
    future: Future[R] = Future()
    future.set_result(value)
    return future


def _main_is_no_file() -> bool:
    """Whether the main script names a file that is not there: read from stdin (`python -`),
    it names "<stdin>"."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path is not None and not os.path.isfile(path)


_HIDING = threading.Lock()  # one map at a time takes __main__.__file__ away and back


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """While a submit starts a worker: it runs the main script again from
    `__main__.__file__` (spawn's rule, which the fork server follows), and every worker died
    of "<stdin>". Hidden, the main is skipped, as for `python -c` and notebooks, which have
    none."""
    with _HIDING:
        main = sys.modules["__main__"]
        path = getattr(main, "__file__", None)
        if path is None:
            yield
            return
        del main.__file__
        try:
            yield
        finally:
            main.__file__ = path


def _widen_result_pipe(pool: ProcessPoolExecutor) -> None:
    """Results of MBs (a chunk of photos) pass through a pipe of 64 KiB by default: a context
    switch between a worker and this process every 64 KiB. Linux lets a pipe hold up to
    /proc/sys/fs/pipe-max-size (1 MiB by default); elsewhere, or refused, it stays as is."""
    import fcntl

    setsize = getattr(fcntl, "F_SETPIPE_SZ", None)
    queue = getattr(pool, "_result_queue", None)
    if setsize is None or queue is None:
        return
    try:
        fcntl.fcntl(queue._writer.fileno(), setsize, 1 << 20)
    except (OSError, AttributeError):
        pass


def _names(items: list[T], describe: Callable[[T], str], limit: int) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(describe(item) for item in items[:limit]) + more


def _hung(batch: list[T], timeout_s: float | None, describe: Callable[[T], str]
          ) -> WorkerError:
    return WorkerError(f"no result for {timeout_s:.0f} s from the worker on "
                       f"{_names(batch, describe, 3)}: it is hung (a stalled read or decode); "
                       "raise the worker timeout if such inputs legitimately take that long")


def _died(in_flight: list[T], describe: Callable[[T], str]) -> WorkerError:
    # A broken pool fails every pending chunk: which input killed it is not known.
    return WorkerError("a worker process died (killed, or out of memory) on one of the inputs "
                       f"in flight: {_names(in_flight, describe, 40)}")


def _terminate(pool: ProcessPoolExecutor) -> None:
    # ProcessPoolExecutor has no public way to stop a busy worker before Python 3.14.
    for proc in list(getattr(pool, "_processes", {}).values()):
        proc.terminate()
