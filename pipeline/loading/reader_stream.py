"""Shards streamed through fsspec (http(s)://, s3://, gs://, memory://, local paths).

    fetch threads (fetch.py): the rank's shards in plan order, `in_flight` at a time, each
      read ahead in bounded chunks (through the local shard cache, when given)
      -> tar parsing (tarread), the open shards' samples interleaved one by one
      -> bounded shuffle buffer seeded from (seed, epoch, rank)
      -> the plan's length -> encoded batches, padded with empty ones up to the plan's count

The position is our own: the number of samples emitted this epoch, and where the replay may
start. Resuming replays the epoch (same shard order, same interleaving, same shuffle buffer
draws) and skips what was emitted, so it continues with exactly the samples that would have
come next; but the shards before the first one still open are not fetched again: they stand
in the replay as their sample counts alone (the buffer's draws depend on how many samples
came, not on what they hold), except their samples still in the shuffle buffer, fetched
again one by one with range requests through the shard's .idx (refetch.py). So a resume
fetches the open shards and at most a shuffle buffer's worth of samples, not the consumed
part of the epoch. Whatever is lost to bad data, a rank yields exactly `plan.batches` batches, so
distributed ranks stay in step.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardflow.errors import DataError, OnError, SkipLog, handle
from shardflow.loading import refetch
from shardflow.loading.batch import EncodedBatch
from shardflow.loading.fetch import Fetcher, FetchStats
from shardflow.loading.readplan import EpochPlan
from shardflow.loading.shardcache import ShardCache
from shardflow.loading.shardlist import ShardSpec
from shardflow.shards.tarread import TarLimits, dotted_key, iter_samples
from shardflow.urls import redact

log = logging.getLogger(__name__)
Sample = dict[str, object]
# A sample's shard (plan position) and place in it; a sample the replay stands in for.
_POS, _ORD, _STANDIN = "__pos__", "__ord__", "__standin__"


@dataclass(frozen=True)
class StreamOptions:
    """How the streaming reader fetches: `in_flight` shards at a time per rank (their samples
    interleaved), through `cache` (a ShardCache of remote shards) when given."""

    in_flight: int = 2
    cache: ShardCache | None = None
    stats: FetchStats = field(default_factory=FetchStats, compare=False)


class _Reading:
    """One pass over a rank's epoch: the samples of its shards, interleaved, filtered and
    shuffled, and at any point where a replay of it may start (`resume_point`)."""

    def __init__(self, plan: EpochPlan, on_error: OnError, skips: SkipLog, limits: TarLimits,
                 options: StreamOptions, start: dict[str, Any] | None) -> None:
        self.plan, self.on_error, self.skips, self.limits = plan, on_error, skips, limits
        # Shards before `standins` are replayed from their counts, without fetching them.
        self.counts: list[int] = [int(n) for n in (start or {}).get("counts", [])]
        self.standins = len(self.counts)
        # Samples of those shards still in the shuffle buffer at the save: fetched again.
        self.stragglers: dict[int, dict[int, str]] = {}
        for pos, ordinal, key in (start or {}).get("stragglers", []):
            self.stragglers.setdefault(int(pos), {})[int(ordinal)] = key
        self.stats = options.stats
        self.in_flight = int((start or {}).get("in_flight", options.in_flight))
        self.yielded: dict[int, int] = {}
        self.open: set[int] = set()
        self.buffer: list[Sample] = []
        self.fetcher = Fetcher(list(plan.shards[self.standins:]), self.in_flight,
                               options.cache, options.stats)

    def __iter__(self) -> Iterator[Sample]:
        stream = self._interleaved()
        if self.plan.stride:  # the rest of an epoch with little left (readplan.py)
            plan = self.plan
            stream = (s for n, s in enumerate(stream) if n % plan.world_size == plan.rank)
        return self._shuffled(stream)

    def resume_point(self) -> dict[str, Any]:
        """Where a replay may start: the shards before `needed` (none open) are replayed
        from their counts; the few of their samples still in the shuffle buffer (a random
        buffer keeps some for long) are fetched again one by one (refetch.py)."""
        needed = min(self.open, default=len(self.plan.shards))
        counts = self.counts[:needed] + [self.yielded.get(p, 0)
                                         for p in range(len(self.counts), needed)]
        stragglers = [[s[_POS], s[_ORD], s["__key__"]] for s in self.buffer
                      if int(s[_POS]) < needed]  # type: ignore[call-overload]
        return {"needed": needed, "counts": counts, "stragglers": stragglers,
                "in_flight": self.in_flight}

    def close(self) -> None:
        self.fetcher.close()

    def _interleaved(self) -> Iterator[Sample]:
        """The open shards' samples one from each in turn; a shard that ends makes room for
        the next in plan order. Deterministic: it depends on the samples each shard
        holds, not on when their bytes arrive. Without shuffling (evaluation) the shards
        come one after the other, in plan order (the open ones are still fetched at once)."""
        total, next_pos = len(self.plan.shards), 0
        turn = 1 if self.plan.shuffle_buffer > 1 else 0
        slots: list[tuple[int, Iterator[Sample]]] = []
        while next_pos < total and len(slots) < self.in_flight:
            slots.append((next_pos, self._shard(next_pos)))
            next_pos += 1
        j = 0
        while slots:
            pos, samples = slots[j]
            sample = next(samples, None)
            if sample is not None:
                yield sample
                j = (j + turn) % len(slots)
                continue
            self.open.discard(pos)
            del slots[j]  # the next shard joins at the end: without shuffling, plan order
            if next_pos < total:
                slots.append((next_pos, self._shard(next_pos)))
                next_pos += 1
            j = j % len(slots) if slots else 0

    def _shard(self, pos: int) -> Iterator[Sample]:
        self.open.add(pos)
        if pos < self.standins:
            return self._stand_in(pos)
        return self._read(pos)

    def _stand_in(self, pos: int) -> Iterator[Sample]:
        """A shard replayed from its count: stand-ins, but its samples that were still in
        the buffer at the save, fetched again, in their places."""
        wanted = self.stragglers.get(pos, {})
        found = refetch.samples_of(self.plan.shards[pos], set(wanted.values()), self.limits,
                                   self.stats) if wanted else {}
        for ordinal in range(self.counts[pos]):
            key = wanted.get(ordinal)
            if key is None:
                yield {_POS: pos, _STANDIN: True}
            else:
                yield {**found[key], _POS: pos, _ORD: ordinal}

    def _read(self, pos: int) -> Iterator[Sample]:
        shard = self.fetcher.next_shard(pos - self.standins)
        if shard is None:
            return
        plan, skips = self.plan, self.skips
        if plan.stride and plan.rank:
            # Every rank reads these shards and keeps its share (__iter__): rank 0 records
            # what they lose, once (each rank did, so a lost shard counted world_size times).
            skips = SkipLog()
        # The keys read before a resume on another number of ranks are passed over, their
        # skips too (reported by the run that met them).
        ids = plan.ids or tuple(range(len(plan.shards)))
        read_before = plan.exclude.get(ids[pos], frozenset())
        # This shard's skips pass through `here` so that a failure can say how many of its
        # samples are left: its count less those read and those already skipped.
        here, done = SkipLog(announce=skips.announce), 0
        try:
            for sample in iter_samples(shard, redact(shard.spec.url), limits=self.limits,  # type: ignore[arg-type]
                                       on_error=self.on_error, skips=here):
                _forget(here, read_before)
                if sample["__key__"] in read_before:
                    continue
                done += 1 + _move(here, skips)
                sample[_POS], sample[_ORD] = pos, self.yielded.get(pos, 0)
                self.yielded[pos] = sample[_ORD] + 1  # type: ignore[operator]
                yield sample
            _forget(here, read_before)
            _move(here, skips)
        except DataError as err:
            _forget(here, read_before)
            done += _move(here, skips)
            shard.cancel()  # the rest of this shard is not read
            handle(_with_loss(err, shard.spec, done), self.on_error, skips)

    def _shuffled(self, stream: Iterator[Sample]) -> Iterator[Sample]:
        plan, buf = self.plan, self.buffer
        if plan.shuffle_buffer <= 1:
            yield from stream
            return
        rng = random.Random(f"buffer/{plan.seed}/{plan.epoch}/{plan.rank}")
        for sample in stream:
            buf.append(sample)
            if len(buf) >= plan.shuffle_buffer:
                i = rng.randrange(len(buf))
                buf[i], buf[-1] = buf[-1], buf[i]
                yield buf.pop()
        rng.shuffle(buf)
        buf.reverse()  # popped from the end: the buffer holds what is left, for resume_point
        while buf:
            yield buf.pop()


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


def batches(plan: EpochPlan, state: dict[str, Any] | None, on_error: OnError,
            exts: tuple[str, ...], limits: TarLimits | None = None,
            extras: tuple[str, ...] = (), options: StreamOptions | None = None
            ) -> Iterator[EncodedBatch]:
    """Encoded batches for the epoch; `state` ({"emitted": n, "batches": b, where the replay
    starts}) resumes after n samples and b batches. Skips met while reading a batch travel
    with that batch. The members named by `extras` go to each batch's `extras` columns (None
    where missing). A sample with none of `exts` but dotted variants of them (`img.0001.jpg`)
    is `dotted-key`."""
    skip_first = int(state["emitted"]) if state else 0
    done = int(state.get("batches", 0)) if state else 0
    if plan.batches is not None and done >= plan.batches:
        return
    # A state saved before replays could start late was made reading one shard at a time.
    start = (state if "counts" in state else {**state, "in_flight": 1}) if state else None
    reading = _Reading(plan, on_error, SkipLog(announce=False), limits or TarLimits(),
                       options or StreamOptions(), start)
    try:
        yield from _batches(reading, plan, skip_first, done, exts, extras)
    finally:
        reading.close()


def _batches(reading: _Reading, plan: EpochPlan, skip_first: int, done: int,
             exts: tuple[str, ...], extras: tuple[str, ...]) -> Iterator[EncodedBatch]:
    emitted, current, pending = 0, EncodedBatch([], [], [], []), reading.skips
    for sample in reading:
        if plan.length is not None and emitted >= plan.length:
            break
        emitted += 1
        if emitted <= skip_first:
            pending.entries.clear()  # met while replaying: reported by the earlier run
            continue
        if _STANDIN in sample:
            raise RuntimeError(f"resuming epoch {plan.epoch}: a shard replayed from its count "
                               "had a sample left to emit; the state does not match the data")
        dotted = dotted_key(sample, exts)
        if dotted is not None:  # several samples under one key: refused like the reader's own
            handle(dotted, reading.on_error, pending)
            continue
        _append(current, sample, exts, extras)
        if len(current) == plan.batch_size:
            done += 1
            yield _finish(current, reading, emitted, done)
            current = EncodedBatch([], [], [], [])
    if len(current) or (pending.entries and (plan.batches is None or done < plan.batches)):
        done += 1
        yield _finish(current, reading, emitted, done)
    # Skips still pending here were met beyond this rank's share of the epoch (read ahead
    # past its even length): those samples are not part of this epoch on this rank.
    while plan.batches is not None and done < plan.batches:  # samples were lost: keep step
        done += 1
        yield _finish(EncodedBatch([], [], [], []), reading, emitted, done)


def _finish(batch: EncodedBatch, reading: _Reading, emitted: int, done: int) -> EncodedBatch:
    batch.state = {"emitted": emitted, "batches": done, **reading.resume_point()}
    batch.skips, reading.skips.entries = list(reading.skips.entries), []
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
