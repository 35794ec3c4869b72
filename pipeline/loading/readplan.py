"""One rank's reading plan for one epoch: which shards, in which order, how many samples.

Every rank computes the same plan for every rank from (source, seed, epoch, world size), so
ranks agree without talking: disjoint shards covering the source, and one common length (the
smallest rank's count) so that all ranks run the same number of batches and DDP never waits
on a rank that has run dry. The samples dropped to get there are reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.loading.shardlist import ShardSpec, Source, epoch_order, even_length, split_ranks


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

    @property
    def batches(self) -> int | None:
        if self.length is None:
            return None
        return -(-self.length // self.batch_size)


def plan_epoch(source: Source, *, epoch: int, seed: int, rank: int, world_size: int,
               shuffle: bool, batch_size: int, shuffle_buffer: int) -> EpochPlan:
    order = epoch_order(source.shards, seed, epoch, shuffle)
    per_rank = split_ranks(order, world_size)
    length, dropped = even_length(per_rank)
    if length == 0:
        empty = next(r for r in range(world_size) if not any(s.samples for s in per_rank[r]))
        raise ValueError(f"rank {empty} would get no samples in epoch {epoch} (its shards are "
                         "empty); use fewer ranks or re-shard")
    return EpochPlan(epoch, seed, rank, world_size, tuple(per_rank[rank]), length, dropped,
                     batch_size, shuffle_buffer if shuffle else 0)
