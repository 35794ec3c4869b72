"""Shards streamed through fsspec (http(s)://, s3://, gs://, memory://, local paths).

    fetch thread: the rank's shards in epoch order, read ahead in bounded chunks
      -> tar parsing (tarread) -> bounded shuffle buffer seeded from (seed, epoch, rank)
      -> the plan's length -> encoded batches, padded with empty ones up to the plan's count

The position is our own: the number of samples emitted this epoch. Resuming replays the epoch
from its start (same shard order, same shuffle buffer draws) and skips what was emitted, so it
continues with exactly the samples that would have come next. Whatever is lost to bad data,
a rank yields exactly `plan.batches` batches, so distributed ranks stay in step.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np

from pipeline.errors import DataError, OnError, SkipLog, handle
from pipeline.loading.batch import EncodedBatch
from pipeline.loading.readplan import EpochPlan
from pipeline.loading.shardlist import ShardSpec
from pipeline.shards.tarread import TarLimits, dotted_key, iter_samples
from pipeline.urls import redact, scrub

log = logging.getLogger(__name__)
CHUNK = 4 * 1024 * 1024
READ_AHEAD_CHUNKS = 16  # at most 64 MiB of shard bytes waiting to be parsed
POLL_S = 0.1
RETRIES = 3  # further tries of a shard whose download breaks
BACKOFF_S = 0.5  # before the first retry; doubled for each next one
_END = object()


class _Shard:
    """One shard's chunks, handed from the fetch thread to the parser. `cancel()` tells the
    fetch thread to stop reading it (the parser gave up on it) and go on to the next."""

    def __init__(self, spec: ShardSpec, stop: threading.Event) -> None:
        self.spec, self.stop = spec, stop
        self.chunks: queue.Queue[Any] = queue.Queue(maxsize=READ_AHEAD_CHUNKS)
        self.cancelled = threading.Event()
        self.buffer, self.pos, self.done = bytearray(), 0, False

    def cancel(self) -> None:
        self.cancelled.set()

    def read(self, n: int = -1) -> bytes:
        while not self.done and (n < 0 or len(self.buffer) - self.pos < n):
            item = _get(self.chunks, self.stop)
            if item is _END:
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


def _get(q: queue.Queue[Any], stop: threading.Event) -> Any:
    while not stop.is_set():
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            continue
    return _END  # stopped: end the stream; the consumer is being closed


class _Fetcher:
    """Reads the shards one after another, each into a bounded queue of chunks."""

    def __init__(self, specs: list[ShardSpec]) -> None:
        self.stop = threading.Event()
        self.shards: queue.Queue[_Shard] = queue.Queue(maxsize=2)
        self.thread = threading.Thread(target=self._run, args=(specs,), daemon=True,
                                       name="shardflow-fetch")
        self.thread.start()

    def _run(self, specs: list[ShardSpec]) -> None:
        for spec in specs:
            shard = _Shard(spec, self.stop)
            if not self._put(self.shards, shard, None):
                return
            self._fetch(shard)

    def _fetch(self, shard: _Shard) -> None:
        """Stream the shard; after a failure, reopen it where it broke off (a range request
        for remote files), up to RETRIES times with exponential back-off."""
        delivered, failures = 0, 0
        while True:
            try:
                self._stream(shard, delivered)
                break
            except _Stopped:
                return
            except _Broken as broken:
                delivered = broken.delivered
                failures += 1
                if failures > RETRIES or not self._back_off(shard, failures, broken.cause):
                    self._put(shard.chunks, _fetch_error(shard, broken.cause, failures), shard)
                    break
        self._put(shard.chunks, _END, shard)

    def _stream(self, shard: _Shard, start: int) -> None:
        delivered = start
        try:
            with fsspec.open(shard.spec.url, "rb", **shard.spec.storage_options) as f:
                if start:
                    f.seek(start)
                while chunk := f.read(CHUNK):
                    if not self._put(shard.chunks, chunk, shard):
                        raise _Stopped
                    delivered += len(chunk)
        except _Stopped:
            raise
        except Exception as exc:  # noqa: BLE001 - retried, then handed to the parser
            raise _Broken(delivered, exc) from None

    def _back_off(self, shard: _Shard, failures: int, cause: Exception) -> bool:
        """Wait before the next try; False when the fetcher or the shard was stopped."""
        log.warning("reading %s failed (%s); try %d of %d in %.1f s", redact(shard.spec.url),
                    type(cause).__name__, failures + 1, RETRIES + 1,
                    BACKOFF_S * 2 ** (failures - 1))
        self.stop.wait(BACKOFF_S * 2 ** (failures - 1))
        return not (self.stop.is_set() or shard.cancelled.is_set())

    def _put(self, q: queue.Queue[Any], item: Any, shard: _Shard | None) -> bool:
        while not self.stop.is_set() and not (shard and shard.cancelled.is_set()):
            try:
                q.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def next_shard(self) -> _Shard | None:
        item = _get(self.shards, self.stop)  # type: ignore[arg-type]
        return None if item is _END else item

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


class _Stopped(Exception):
    """The consumer stopped this shard or the whole fetcher."""


class _Broken(Exception):
    def __init__(self, delivered: int, cause: Exception) -> None:
        self.delivered, self.cause = delivered, cause


def _fetch_error(shard: _Shard, exc: Exception, tries: int) -> DataError:
    # The message may hold the URL, query string included: scrub it.
    return DataError("fetch-failed", f"reading the shard failed {tries} times, last with "
                     f"{type(exc).__name__}: {scrub(str(exc))}", source=redact(shard.spec.url))


def samples(plan: EpochPlan, on_error: OnError, skips: SkipLog,
            limits: TarLimits) -> Iterator[dict[str, object]]:
    """The epoch's samples for this rank, shuffled through a bounded buffer."""
    fetcher = _Fetcher(list(plan.shards))
    try:
        stream = _read_all(fetcher, plan, on_error, skips, limits)
        if plan.stride:  # the rest of an epoch with fewer shards than ranks (readplan.py)
            stream = (s for n, s in enumerate(stream) if n % plan.world_size == plan.rank)
        yield from _shuffled(stream, plan)
    finally:
        fetcher.close()


def _read_all(fetcher: _Fetcher, plan: EpochPlan, on_error: OnError, skips: SkipLog,
              limits: TarLimits) -> Iterator[dict[str, object]]:
    for i in plan.ids or range(len(plan.shards)):
        shard = fetcher.next_shard()
        if shard is None:
            return
        # The keys read before a resume on another number of ranks are passed over, their
        # skips too (reported by the run that met them).
        read_before = plan.exclude.get(i, frozenset())
        # This shard's skips pass through `here` so that a failure can say how many of its
        # samples are left: its count less those read and those already skipped.
        here, done = SkipLog(announce=skips.announce), 0
        try:
            for sample in iter_samples(shard, redact(shard.spec.url), limits=limits,  # type: ignore[arg-type]
                                       on_error=on_error, skips=here):
                _forget(here, read_before)
                if sample["__key__"] in read_before:
                    continue
                done += 1 + _move(here, skips)
                yield sample
            _forget(here, read_before)
            _move(here, skips)
        except DataError as err:
            _forget(here, read_before)
            done += _move(here, skips)
            shard.cancel()  # the rest of this shard is not read
            handle(_with_loss(err, shard.spec, done), on_error, skips)


def _forget(log: SkipLog, read_before: frozenset[str]) -> None:
    if read_before and log.entries:
        log.entries = [e for e in log.entries if e.get("key") not in read_before]


def _move(src: SkipLog, dst: SkipLog) -> int:
    """Move `src`'s entries to `dst`; the samples they stand for."""
    if not src.entries:  # the common case, once per sample read
        return 0
    moved = src.samples()
    dst.extend(src.entries)
    src.entries = []
    return moved


def _with_loss(err: DataError, spec: ShardSpec, done: int) -> DataError:
    """Name how many samples the lost rest of a shard held (its count less the `done` ones
    read or skipped), when the count is known."""
    if spec.samples is None:  # a shard without a count: how much was lost is unknown
        return DataError(err.reason, err.detail, source=err.source, key=err.key, samples=None)
    lost = max(spec.samples - done, 0)
    return DataError(err.reason, f"{err.detail}; {lost} samples of this shard are lost",
                     source=err.source, key=err.key, samples=lost)


def _shuffled(stream: Iterator[dict[str, object]], plan: EpochPlan
              ) -> Iterator[dict[str, object]]:
    if plan.shuffle_buffer <= 1:
        yield from stream
        return
    rng = random.Random(f"buffer/{plan.seed}/{plan.epoch}/{plan.rank}")
    buf: list[dict[str, object]] = []
    for sample in stream:
        buf.append(sample)
        if len(buf) >= plan.shuffle_buffer:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


def batches(plan: EpochPlan, state: dict[str, Any] | None, on_error: OnError,
            exts: tuple[str, ...], limits: TarLimits | None = None,
            extras: tuple[str, ...] = ()) -> Iterator[EncodedBatch]:
    """Encoded batches for the epoch; `state` ({"emitted": n, "batches": b}) resumes after n
    samples and b batches. Skips met while reading a batch travel with that batch. The
    members named by `extras` go to each batch's `extras` columns (None where missing). A
    sample with none of `exts` but dotted variants of them (`img.0001.jpg`) is `dotted-key`."""
    skip_first = int(state["emitted"]) if state else 0
    done = int(state.get("batches", 0)) if state else 0
    if plan.batches is not None and done >= plan.batches:
        return
    emitted, current, pending = 0, EncodedBatch([], [], [], []), SkipLog(announce=False)
    for sample in samples(plan, on_error, pending, limits or TarLimits()):
        if plan.length is not None and emitted >= plan.length:
            break
        emitted += 1
        if emitted <= skip_first:
            pending.entries.clear()  # met while replaying: reported by the earlier run
            continue
        dotted = dotted_key(sample, exts)
        if dotted is not None:  # several samples under one key: refused like the reader's own
            handle(dotted, on_error, pending)
            continue
        _append(current, sample, exts, extras)
        if len(current) == plan.batch_size:
            done += 1
            yield _finish(current, pending, emitted, done)
            current = EncodedBatch([], [], [], [])
    if len(current) or (pending.entries and (plan.batches is None or done < plan.batches)):
        done += 1
        yield _finish(current, pending, emitted, done)
    # Skips still pending here were met beyond this rank's share of the epoch (read ahead
    # past its even length): those samples are not part of this epoch on this rank.
    while plan.batches is not None and done < plan.batches:  # samples were lost: keep step
        done += 1
        yield _finish(EncodedBatch([], [], [], []), pending, emitted, done)


def _finish(batch: EncodedBatch, pending: SkipLog, emitted: int, done: int) -> EncodedBatch:
    batch.state = {"emitted": emitted, "batches": done}
    batch.skips, pending.entries = list(pending.entries), []
    return batch


def _append(batch: EncodedBatch, sample: dict[str, object], exts: tuple[str, ...],
            extras: tuple[str, ...] = ()) -> None:
    data = next((sample[e] for e in exts if e in sample), b"")
    batch.keys.append(str(sample["__key__"]))
    batch.urls.append(str(sample["__url__"]))
    batch.data.append(np.frombuffer(data, dtype=np.uint8))  # type: ignore[call-overload]
    label = sample.get("cls")
    batch.labels.append(label if isinstance(label, bytes) else None)
    for ext in extras:
        value = sample.get(ext)
        batch.extras.setdefault(ext, []).append(value if isinstance(value, bytes) else None)
