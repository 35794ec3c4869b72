"""How shards fall on ranks and workers: rank first, then worker, both round-robin.

Rank r of W takes shards r, r+W, r+2W...; worker k of K within a rank takes every K-th of
those. Every (rank, worker) must get at least one shard, or it would have nothing to read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def rank_slice(items: Sequence[T], rank: int, world_size: int) -> list[T]:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not in [0, world_size={world_size})")
    return list(items[rank::world_size])


def worker_slice(items: Sequence[T], worker: int, num_workers: int) -> list[T]:
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker={worker} is not in [0, num_workers={num_workers})")
    return list(items[worker::num_workers])


def assignment(items: Sequence[T], world_size: int,
               num_workers: int) -> dict[tuple[int, int], list[T]]:
    """{(rank, worker): items} for every rank and worker, empty lists included."""
    return {(r, k): worker_slice(rank_slice(items, r, world_size), k, num_workers)
            for r in range(world_size) for k in range(num_workers)}
