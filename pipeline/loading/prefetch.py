"""Prefetching: bounded background stages (the copies to the device are in delivery.py).

A `Stage` runs a generator in its own thread and hands its items over a bounded queue, so a
slow consumer stops the producer instead of letting memory grow; an exception raised in the
producer is re-raised in the consumer, and `close()` stops and joins the thread.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
A = TypeVar("A")
R = TypeVar("R")
_DONE = object()  # the producer finished
_STOPPED = object()  # the stage was closed before that
POLL_S = 0.1  # how often a blocked put/get rechecks whether the stage was closed


class Burst(list):  # type: ignore[type-arg]
    """Items a producer hands over at once: one queue entry, one wake-up of the consumer,
    which iterates them one by one. Each hand-over between two Python threads costs a GIL
    round trip (measured about 65 us of the producer's CPU, with DALI's threads busy beside
    them), a quarter of the text loader's time with batches of ~0.4 ms; a producer that makes
    several items at once (packed text: the batches of a read) hands them over together. A
    queue entry is then up to a burst: the producer bounds its bursts."""


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Stage(Generic[T]):
    """Iterate `produce(stop)` in a thread, `depth` items ahead of the consumer.

    `parent_stop` is the stop event of the stage that consumes this one (if any): a consumer
    waiting here gives up when either is set, so closing an outer stage never waits on an
    inner one that is blocked.
    """

    def __init__(self, produce: Callable[[threading.Event], Iterator[T | Burst]], *, depth: int,
                 name: str, parent_stop: threading.Event | None = None,
                 timeout_s: float | None = None) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._parent_stop = parent_stop
        self.completed = False  # True once the producer's last item was consumed
        self.timeout_s = timeout_s  # a producer silent this long is declared hung
        self._thread = threading.Thread(target=self._run, args=(produce,), name=name,
                                        daemon=True)
        self._thread.start()

    def _run(self, produce: Callable[[threading.Event], Iterator[T | Burst]]) -> None:
        try:
            for item in produce(self._stop):
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer thread
            self._put(_Raised(exc))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[T]:
        while True:
            item = self._get()
            if item is _DONE:
                self.completed = True
                return
            if item is _STOPPED:
                return
            if isinstance(item, _Raised):
                raise item.exc
            if isinstance(item, Burst):
                yield from item
            else:
                yield item

    def _get(self) -> Any:
        waited_since = time.monotonic()
        while True:
            if self._stop.is_set() or (self._parent_stop and self._parent_stop.is_set()):
                return _STOPPED  # closed: end quietly, there is no one to report to
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    return _Raised(RuntimeError(f"{self._thread.name} stopped without a word"))
                if self.timeout_s and time.monotonic() - waited_since > self.timeout_s:
                    return _Raised(TimeoutError(
                        f"{self._thread.name} produced nothing for {self.timeout_s:.0f} s: it "
                        "is hung (a stalled read or decode); raise the loader's timeout_s if "
                        "its batches are legitimately that slow"))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the producer and wait for its thread; warn (not hang) if it does not stop: a
        thread stuck in a read cannot be interrupted, and it is a daemon."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s did not stop within %.0f s (blocked in I/O?); it is a daemon "
                        "thread and ends with the process", self._thread.name, timeout)


def ahead(fn: Callable[[Any], R], items: Iterable[tuple[A, Any]], depth: int, *, name: str,
          workers: int = 1, initializer: Callable[[], None] | None = None
          ) -> Generator[tuple[A, R], None, None]:
    """(a, fn(b)) for each (a, b) of `items`, in order, with fn running in `workers` helper
    threads up to `depth` items ahead: for an fn that releases the GIL (a tokenizer in Rust),
    which then overlaps with what the caller does with each result. `items` is iterated in
    the caller's thread. The threads end with the iteration (done, closed, or an exception,
    which fn's own re-raises here); fn calls not yet begun are dropped. An exception from
    `items` comes after the results of the items before it, as it would without the helpers.
    `initializer` runs first in each helper thread (one_core_in_this_thread, say)."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=initializer)
    pending: deque[tuple[A, Future[R]]] = deque()
    failed: Exception | None = None
    source = iter(items)
    try:
        while True:
            try:  # only the items' own error waits for what came before it
                a, b = next(source)
            except StopIteration:
                break
            except Exception as exc:
                failed = exc
                break
            pending.append((a, pool.submit(fn, b)))
            # the oldest as soon as it is done, or once `depth` are waiting behind it; fn's
            # error is raised here, in order, before any later result
            while pending and (len(pending) > depth or pending[0][1].done()):
                first, result = pending.popleft()
                yield first, result.result()
        while pending:
            first, result = pending.popleft()
            yield first, result.result()
        if failed is not None:
            raise failed
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def one_core_in_this_thread() -> None:
    """Run this thread's torch CPU ops on one core, leaving every other thread as it was.

    A decode stage resizes or voxelizes one small batch at a time; torch's OpenMP workers would
    then spin between them on the cores DALI decodes on (measured: the loader ran 1.5x
    slower). torch.set_num_threads(1) would also change the default of threads started later
    and MKL's process-wide setting, i.e. the training thread. OpenMP's own setting is per
    thread; it must come after this thread's first parallel op, which initialises the thread's
    count.
    """
    import torch
    import torch.nn.functional as F

    F.interpolate(torch.zeros(1, 3, 2, 2), size=(1, 1), mode="bilinear", antialias=True)
    # torch's own first-use setup of this thread, made sure of: it copies the count last
    # given to torch.set_num_threads by any thread (FFCV's loader sets one, for instance) and
    # would undo the setting below if it ran after it (the op above may not run it).
    torch.get_num_threads()
    try:
        ctypes.CDLL(None).omp_set_num_threads(1)
    except AttributeError:  # torch built without GNU/LLVM OpenMP: nothing spins to stop
        log.debug("no omp_set_num_threads in this process; decode threads left as they are")
