"""One rank's reading plan for one epoch: which shards, in which order, how many samples.

Every rank computes the same plan for every rank from (source, seed, epoch, world size), so
ranks agree without talking: disjoint shards covering the source, and one common length (the
smallest rank's count) so that all ranks run the same number of batches and DDP never waits
on a rank that has run dry. The samples dropped to get there are reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from shardflow.loading.shardlist import ShardSpec, Source, epoch_order, even_length, split_ranks


@dataclass(frozen=True)
class EpochPlan:
    epoch: int
    seed: int
    rank: int
    world_size: int
    shards: tuple[ShardSpec, ...]  # this rank's shards, in this epoch's order
    length: int | None  # samples this rank reads (None: unknown, read until the shards end)
    dropped: int  # samples all ranks together leave out this epoch to even out
    batch_size: int
    shuffle_buffer: int  # 0 or 1: no sample shuffling
    # Each shard's index in the source (consumed.py names shards by it).
    ids: tuple[int, ...] = field(default=(), compare=False)
    # The rest of an epoch resumed on another number of ranks (plan_rest): the keys of each
    # shard (by index) read before, which the reader passes over; what was read before, as a
    # snapshot (consumed.py); and whether every rank reads all the shards and keeps every
    # world_size-th sample (fewer shards left than ranks).
    rest: bool = False
    exclude: dict[int, frozenset[str]] = field(default_factory=dict, compare=False)
    consumed: dict[str, Any] | None = field(default=None, compare=False)
    stride: bool = False

    @property
    def batches(self) -> int | None:
        if self.length is None:
            return None
        return -(-self.length // self.batch_size)


def plan_epoch(source: Source, *, epoch: int, seed: int, rank: int, world_size: int,
               shuffle: bool, batch_size: int, shuffle_buffer: int) -> EpochPlan:
    # A shard known to hold no samples is planned for no rank: a reader is never handed one
    # (DALI's refuses an empty index), and it never takes a rank's place.
    ids = [i for i in epoch_order(range(len(source.shards)), seed, epoch, shuffle)
           if source.shards[i].samples != 0]
    per_rank = split_ranks([source.shards[i] for i in ids], world_size)
    length, dropped = even_length(per_rank)
    if length == 0:
        empty = next(r for r in range(world_size) if not any(s.samples for s in per_rank[r]))
        raise ValueError(f"rank {empty} would get no samples in epoch {epoch} (its shards are "
                         "empty); use fewer ranks or re-shard")
    return EpochPlan(epoch, seed, rank, world_size, tuple(per_rank[rank]), length, dropped,
                     batch_size, shuffle_buffer if shuffle else 0,
                     ids=_ids_of(source, per_rank[rank]))


def _ids_of(source: Source, shards: list[ShardSpec]) -> tuple[int, ...]:
    where = {s.url: i for i, s in enumerate(source.shards)}
    return tuple(where[s.url] for s in shards)


def plan_rest(source: Source, *, epoch: int, seed: int, rank: int, world_size: int,
              shuffle: bool, batch_size: int, shuffle_buffer: int, done: set[int],
              partial: dict[int, set[str]], consumed: dict[str, Any]) -> EpochPlan:
    """The rest of `epoch` after the shards `done` and the keys `partial` were read (by any
    number of ranks): the shards left, in the epoch's order, each counted by what is left of
    it and split over `world_size` ranks as plan_epoch splits a whole epoch. With fewer shards
    left than ranks, every rank reads them all and keeps every world_size-th sample."""
    ids = [i for i in epoch_order(range(len(source.shards)), seed, epoch, shuffle)
           if i not in done]
    left = [replace(source.shards[i], samples=_left(source.shards[i], partial.get(i)))
            for i in ids]
    keep = [(i, s) for i, s in zip(ids, left, strict=True) if s.samples]
    exclude = {i: frozenset(partial[i]) for i, _ in keep if i in partial}
    common: dict[str, Any] = {
        "epoch": epoch, "seed": seed, "rank": rank, "world_size": world_size,
        "batch_size": batch_size, "shuffle_buffer": shuffle_buffer if shuffle else 0,
        "rest": True, "exclude": exclude, "consumed": consumed}
    total = sum(s.samples or 0 for _, s in keep)
    biggest = max((s.samples or 0 for s in source.shards), default=0)
    if len(keep) >= world_size and total >= world_size * biggest:
        per_rank = split_ranks([s for _, s in keep], world_size)
        length, dropped = even_length(per_rank)
        where = {s.url: i for i, s in keep}
        return EpochPlan(shards=tuple(per_rank[rank]), length=length, dropped=dropped,
                         ids=tuple(where[s.url] for s in per_rank[rank]), **common)
    return EpochPlan(shards=tuple(s for _, s in keep), length=total // world_size,
                     dropped=total % world_size, ids=tuple(i for i, _ in keep), stride=True,
                     **common)


def _left(spec: ShardSpec, read: set[str] | None) -> int:
    return (spec.samples or 0) - len(read or ())
