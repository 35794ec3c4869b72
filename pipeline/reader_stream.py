"""Shards streamed through fsspec (http(s)://, s3://, gs://, memory://, local paths).

    fetch thread: the rank's shards in epoch order, read ahead in bounded chunks
      -> tar parsing (tarread) -> bounded shuffle buffer seeded from (seed, epoch, rank)
      -> the plan's length -> encoded batches

The position is our own: the number of samples emitted this epoch. Resuming replays the epoch
from its start (same shard order, same shuffle buffer draws) and skips what was emitted, so it
continues with exactly the samples that would have come next.
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

from pipeline.batch import EncodedBatch
from pipeline.errors import DataError, OnError, SkipLog, handle
from pipeline.readplan import EpochPlan
from pipeline.tarread import TarLimits, iter_samples
from pipeline.urls import redact

log = logging.getLogger(__name__)
CHUNK = 4 * 1024 * 1024
READ_AHEAD_CHUNKS = 16  # at most 64 MiB of shard bytes waiting to be parsed
IMAGE_EXTS = ("jpg", "png", "jpeg")
_END = object()


class _ChunkStream:
    """A read-only file over the chunks of one shard that the fetch thread queues."""

    def __init__(self, chunks: queue.Queue[Any]) -> None:
        self.chunks, self.buffer, self.done = chunks, b"", False

    def read(self, n: int = -1) -> bytes:
        while not self.done and (n < 0 or len(self.buffer) < n):
            item = self.chunks.get()
            if item is _END:
                self.done = True
            elif isinstance(item, BaseException):
                raise item
            else:
                self.buffer += item
        if n < 0:
            n = len(self.buffer)
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out


class _Fetcher:
    """Reads the shards one after another into a bounded queue of chunks, per shard."""

    def __init__(self, urls: list[str]) -> None:
        self.streams: queue.Queue[tuple[str, queue.Queue[Any]]] = queue.Queue(maxsize=2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(urls,), daemon=True,
                                       name="shardflow-fetch")
        self.thread.start()

    def _run(self, urls: list[str]) -> None:
        for url in urls:
            chunks: queue.Queue[Any] = queue.Queue(maxsize=READ_AHEAD_CHUNKS)
            if not self._put(self.streams, (url, chunks)):
                return
            try:
                with fsspec.open(url, "rb") as f:
                    while chunk := f.read(CHUNK):
                        if not self._put(chunks, chunk):
                            return
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                self._put(chunks, DataError("fetch-failed", f"reading the shard failed: {exc}",
                                            source=redact(url)))
            self._put(chunks, _END)

    def _put(self, q: queue.Queue[Any], item: Any) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def shards(self, count: int) -> Iterator[tuple[str, _ChunkStream]]:
        for _ in range(count):
            url, chunks = self.streams.get()
            yield url, _ChunkStream(chunks)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def samples(plan: EpochPlan, on_error: OnError, skips: SkipLog,
            limits: TarLimits) -> Iterator[dict[str, object]]:
    """The epoch's samples for this rank, shuffled through a bounded buffer."""
    fetcher = _Fetcher([s.url for s in plan.shards])
    try:
        stream = _read_all(fetcher, len(plan.shards), on_error, skips, limits)
        yield from _shuffled(stream, plan)
    finally:
        fetcher.close()


def _read_all(fetcher: _Fetcher, count: int, on_error: OnError, skips: SkipLog,
              limits: TarLimits) -> Iterator[dict[str, object]]:
    for url, stream in fetcher.shards(count):
        try:
            yield from iter_samples(stream, redact(url), limits=limits, on_error=on_error,  # type: ignore[arg-type]
                                    skips=skips)
        except DataError as err:
            handle(err, on_error, skips)  # the rest of this shard is lost; named in the log


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


def batches(plan: EpochPlan, state: dict[str, Any] | None, on_error: OnError, skips: SkipLog,
            limits: TarLimits | None = None) -> Iterator[EncodedBatch]:
    """Encoded batches for the epoch; `state` ({"emitted": n}) resumes after n samples."""
    skip_first = int(state["emitted"]) if state else 0
    emitted, current = 0, EncodedBatch([], [], [], [])
    replay = SkipLog(announce=False)  # skips met while replaying were reported before
    for sample in samples(plan, on_error, replay if skip_first else skips, limits or TarLimits()):
        if plan.length is not None and emitted >= plan.length:
            break
        emitted += 1
        if emitted <= skip_first:
            continue
        if emitted == skip_first + 1 and skip_first:
            replay = skips  # noqa: F841 - from here on, skips are new
        _append(current, sample)
        if len(current) == plan.batch_size:
            current.state = {"emitted": emitted}
            yield current
            current = EncodedBatch([], [], [], [])
    if len(current):
        current.state = {"emitted": emitted}
        yield current


def _append(batch: EncodedBatch, sample: dict[str, object]) -> None:
    image = next((sample[e] for e in IMAGE_EXTS if e in sample), b"")
    batch.keys.append(str(sample["__key__"]))
    batch.urls.append(str(sample["__url__"]))
    batch.data.append(np.frombuffer(image, dtype=np.uint8))  # type: ignore[call-overload]
    label = sample.get("cls")
    batch.labels.append(label if isinstance(label, bytes) else None)
