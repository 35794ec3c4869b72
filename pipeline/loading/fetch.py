"""Fetching shards for the streaming reader: several at once, each into its own bounded queue
of chunks, retried where a download breaks, through the local shard cache when there is one.

    fetcher = Fetcher(specs, in_flight=3, cache=None)
    shard = fetcher.next_shard(0)    # the plan's shards, in plan order, as file-like objects
    shard.read(n) ...                # blocks until the fetch thread has the bytes

`in_flight` threads each take the next shard in plan order and stream it into its queue; the
parser reads `in_flight` shards at a time (reader_stream interleaves their samples), so every
thread has a reader. The queues together hold at most READ_AHEAD_BYTES.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import fsspec

from shardflow.errors import DataError
from shardflow.loading.shardcache import CacheWriter, ShardCache
from shardflow.loading.shardlist import ShardSpec
from shardflow.shards.listing import retry_wait
from shardflow.storage import timed
from shardflow.urls import BACKOFF_S, RETRIES, is_remote, redact, scrub

log = logging.getLogger(__name__)
CHUNK = 4 * 1024 * 1024
READ_AHEAD_BYTES = 64 * 1024 * 1024  # shard bytes waiting to be parsed, all shards together
POLL_S = 0.1
END = object()


@dataclass
class FetchStats:
    """What a loader's streaming reader fetched, over all its epochs: bytes read from remote
    storage, remote shards opened, and those served whole from the local cache."""

    remote_bytes: int = 0
    remote_shards: int = 0
    cache_hits: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


class Shard:
    """One shard's chunks, handed from a fetch thread to the parser. `cancel()` tells the
    thread to stop reading it (the parser gave up on it) and go on to the next."""

    def __init__(self, spec: ShardSpec, stop: threading.Event, depth: int) -> None:
        self.spec, self.stop = spec, stop
        self.chunks: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.cancelled = threading.Event()
        self.buffer, self.pos, self.done = bytearray(), 0, False

    def cancel(self) -> None:
        self.cancelled.set()

    def read(self, n: int = -1) -> bytes:
        while not self.done and (n < 0 or len(self.buffer) - self.pos < n):
            item = get(self.chunks, self.stop)
            if item is END:
                self.done = True
            elif isinstance(item, BaseException):
                raise item
            else:
                del self.buffer[: self.pos]  # keep the buffer to what is not read yet
                self.pos = 0
                self.buffer += item
        end = len(self.buffer) if n < 0 else min(len(self.buffer), self.pos + n)
        out = bytes(self.buffer[self.pos: end])
        self.pos = end
        return out


def get(q: queue.Queue[Any], stop: threading.Event) -> Any:
    while not stop.is_set():
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            continue
    return END  # stopped: end the stream; the consumer is being closed


class Fetcher:
    """Streams `specs` with `in_flight` threads, handing each shard out in plan order."""

    def __init__(self, specs: list[ShardSpec], in_flight: int = 2,
                 cache: ShardCache | None = None, stats: FetchStats | None = None) -> None:
        self.specs, self.cache = specs, cache
        self.stats = stats if stats is not None else FetchStats()
        self.stop = threading.Event()
        self.depth = max(2, READ_AHEAD_BYTES // CHUNK // max(in_flight, 1))
        self._next, self._ready = 0, dict[int, Shard]()
        self._cond = threading.Condition()
        self.threads = [threading.Thread(target=self._run, daemon=True,
                                         name=f"shardflow-fetch-{i}")
                        for i in range(max(1, min(in_flight, len(specs))))]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self._cond:
                index = self._next
                if index >= len(self.specs):
                    return
                self._next += 1
                shard = Shard(self.specs[index], self.stop, self.depth)
                self._ready[index] = shard
                self._cond.notify_all()
            self._fetch(shard)

    def next_shard(self, index: int) -> Shard | None:
        """The shard at `index` of the plan's list (None once stopped)."""
        with self._cond:
            while index not in self._ready and not self.stop.is_set():
                self._cond.wait(POLL_S)
            return self._ready.pop(index, None)

    def _fetch(self, shard: Shard) -> None:
        """Stream the shard; after a failure (a server that timed out too), reopen it where it
        broke off (a range request for remote files), up to RETRIES times with exponential
        back-off, or the wait a 429 or 503 asks for."""
        source, writer = self._source(shard.spec)
        delivered, failures, whole = 0, 0, False
        while not whole:
            try:
                self._stream(shard, source, delivered, writer)
                whole = True
            except _Stopped:
                _abort(writer)
                return
            except _Broken as broken:
                if source != shard.spec.url and not broken.delivered:
                    source = shard.spec.url  # the cached copy went away (evicted): fetch it
                    continue
                delivered = broken.delivered
                failures += 1
                if failures > RETRIES or not self._back_off(shard, failures, broken.cause):
                    _abort(writer)
                    self._put(shard.chunks, _fetch_error(shard, broken.cause, failures), shard)
                    break
        if whole and writer is not None:
            writer.commit()
        self._put(shard.chunks, END, shard)

    def _source(self, spec: ShardSpec) -> tuple[str, CacheWriter | None]:
        """Where to read `spec` from (its cached copy, when whole) and the cache writer that
        keeps what is read of a remote shard (None: not cached)."""
        if self.cache is None or not is_remote(spec.url):
            return spec.url, None
        cached = self.cache.lookup(spec)
        if cached is not None:
            self.stats.add(cache_hits=1)
            return str(cached), None
        return spec.url, self.cache.writer(spec)

    def _stream(self, shard: Shard, source: str, start: int,
                writer: CacheWriter | None) -> None:
        delivered, remote = start, source == shard.spec.url and is_remote(source)
        options = shard.spec.storage_options if source == shard.spec.url else {}
        if remote and not start:
            self.stats.add(remote_shards=1)
        try:
            with timed("reading shard", source, options), \
                    fsspec.open(source, "rb", **options) as f:
                if start:
                    f.seek(start)
                while chunk := f.read(CHUNK):
                    if not self._put(shard.chunks, chunk, shard):
                        raise _Stopped
                    delivered += len(chunk)
                    if remote:
                        self.stats.add(remote_bytes=len(chunk))
                    if writer is not None:
                        writer.write(chunk)
        except _Stopped:
            raise
        except Exception as exc:  # noqa: BLE001 - retried, then handed to the parser
            raise _Broken(delivered, exc) from None

    def _back_off(self, shard: Shard, failures: int, cause: Exception) -> bool:
        """Wait before the next try; False when the fetcher or the shard was stopped."""
        wait = retry_wait(cause, failures - 1, BACKOFF_S)
        log.warning("reading %s failed (%s); try %d of %d in %.1f s", redact(shard.spec.url),
                    type(cause).__name__, failures + 1, RETRIES + 1, wait)
        self.stop.wait(wait)
        return not (self.stop.is_set() or shard.cancelled.is_set())

    def _put(self, q: queue.Queue[Any], item: Any, shard: Shard | None) -> bool:
        while not self.stop.is_set() and not (shard and shard.cancelled.is_set()):
            try:
                q.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


def _abort(writer: CacheWriter | None) -> None:
    if writer is not None:
        with contextlib.suppress(OSError):
            writer.abort()


class _Stopped(Exception):
    """The consumer stopped this shard or the whole fetcher."""


class _Broken(Exception):
    def __init__(self, delivered: int, cause: Exception) -> None:
        self.delivered, self.cause = delivered, cause


def _fetch_error(shard: Shard, exc: Exception, tries: int) -> DataError:
    # The message may hold the URL, query string included: scrub it.
    return DataError("fetch-failed", f"reading the shard failed {tries} times, last with "
                     f"{type(exc).__name__}: {scrub(str(exc))}", source=redact(shard.spec.url))
