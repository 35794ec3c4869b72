"""What a rank has read of its epoch, by shard and key: the part of a position that does not
depend on the rank or on how many ranks there are.

A reader's own position (DALI's checkpoint, the streaming reader's sample count) continues a
rank exactly, but only with the same plan. To resume on another number of ranks, the loader
must know which samples are used up; every encoded batch's state therefore carries a snapshot:

    {"done": [3, 7], "partial": [[12, ["k041", "k007"]]]}

shards by their index in the source (after the shards dropped before planning), whole (their
count reached) or in part (the keys read so far). A sample counts as read once the reader has
handed it out, whatever came of it next: decoded, skipped as bad, or on the other side of a
holdout split. With a shuffle buffer only a few shards are in part at a time, so a snapshot
stays small (about the buffer's keys) however long the epoch. It is written out only when
the state is saved or resumed from (deferred.py): a batch's state holds how far each list of
keys reached, not a copy of it.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterator
from typing import Any

from shardflow.loading.batch import EncodedBatch
from shardflow.loading.deferred import Deferred
from shardflow.loading.readplan import EpochPlan
from shardflow.urls import redact

_NEVER = math.inf  # the count of a shard whose count is unknown: never done by counting
Snapshot = dict[str, Any]  # {"done": [index, ...], "partial": [[index, [key, ...]], ...]}


def shard_index(plan: EpochPlan) -> dict[str, int]:
    """Each of the plan's shards' index in the source, by its URL as given and as the readers
    name it (credentials redacted)."""
    index: dict[str, int] = {}
    for spec, i in zip(plan.shards, plan.ids, strict=False):
        index[spec.url] = index[redact(spec.url)] = i
    return index


class Tracker:
    """Counts a rank's reads per shard, from `start` (a snapshot, or None: nothing read)."""

    def __init__(self, plan: EpochPlan, start: Snapshot | None) -> None:
        self.index = shard_index(plan)
        self.total: dict[int, int] = {}
        for spec, i in zip(plan.shards, plan.ids, strict=True):
            if spec.samples is not None and not plan.stride:  # strided: counts are not ours
                self.total[i] = spec.samples + len(plan.exclude.get(i, ()))
        self.done: set[int] = set()  # only grows
        self.partial: dict[int, list[str]] = {}  # a shard's list only grows, until it is done
        self._done_sorted: list[int] = []
        self.add_snapshot(start or plan.consumed)

    def add_snapshot(self, snap: Snapshot | None) -> None:
        if not snap:
            return
        self.done.update(int(i) for i in snap["done"])
        for i, keys in snap["partial"]:
            for key in keys:
                self._add(int(i), key)

    def add(self, enc: EncodedBatch) -> None:
        """The samples of `enc` as the reader read them (before any drop), and its skips:
        a skip with a key is a sample read; one without (a shard lost whole or from some
        point on) ends that shard."""
        # A read holds samples of a few shards, interleaved by the shuffle buffer: ordered by
        # shard (stably: each shard's keys in reading order) they are a few runs, each added
        # at once. A call per sample here was a tenth of the pre-tokenized text loader's time.
        urls, keys = enc.urls, enc.keys
        if len(urls) > 1:
            get = operator.itemgetter(*sorted(range(len(urls)), key=urls.__getitem__))
            urls, keys = get(urls), get(keys)
        start = 0
        for url, run in itertools.groupby(urls):
            end = start + len(list(run))
            i = self.index.get(url)
            if i is not None:
                self._add_run(i, list(keys[start:end]))
            start = end
        for skip in enc.skips:
            i = self.index.get(skip.get("source", ""))
            if i is None:
                continue
            if skip.get("key"):
                self._add(i, skip["key"])
            else:
                self.done.add(i)
                self.partial.pop(i, None)

    def _add(self, i: int, key: str) -> None:
        self._add_run(i, [key])

    def _add_run(self, i: int, run: list[str]) -> None:
        """Keys read of shard `i`, in order; those past its count are not kept (it is done)."""
        if i in self.done:
            return
        keys = self.partial.setdefault(i, [])
        total = self.total.get(i, _NEVER)
        keys.extend(run if total == _NEVER else run[: max(int(total) - len(keys), 0)])
        if len(keys) >= total:
            self.done.add(i)
            del self.partial[i]

    def snapshot(self) -> Deferred:
        """The snapshot as of now, written out when a state is used (deferred.py). A length
        per list of keys fixes it: lists are appended to, never changed otherwise."""
        if len(self._done_sorted) != len(self.done):  # `done` only grows
            self._done_sorted = sorted(self.done)
        done = self._done_sorted
        partial = [(i, keys, len(keys)) for i, keys in sorted(self.partial.items())]
        return Deferred(lambda: {"done": list(done),
                                 "partial": [[i, keys[:n]] for i, keys, n in partial]})


def follow(batches: Iterator[EncodedBatch], plan: EpochPlan, state: dict[str, Any] | None
           ) -> Iterator[EncodedBatch]:
    """`batches`, each one's state with the snapshot of what was read up to it added. Not
    tracked where a shard's count is unknown (one rank only: nothing to resume elsewhere),
    which would keep every key of the epoch."""
    if any(s.samples is None for s in plan.shards) and not plan.stride:
        yield from batches
        return
    tracker = Tracker(plan, state.get("consumed") if state else None)
    for enc in batches:
        tracker.add(enc)
        enc.state = {**enc.state, "consumed": tracker.snapshot()}
        yield enc


def union(snapshots: list[Snapshot | None]) -> tuple[set[int], dict[int, set[str]]]:
    """(whole shards, keys read of the others) of several ranks' snapshots together."""
    done: set[int] = set()
    partial: dict[int, set[str]] = {}
    for snap in snapshots:
        if not snap:
            continue
        done.update(int(i) for i in snap["done"])
        for i, keys in snap["partial"]:
            partial.setdefault(int(i), set()).update(keys)
    for i in done:
        partial.pop(i, None)
    return done, partial
