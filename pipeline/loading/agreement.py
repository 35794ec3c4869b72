"""Ranks agreeing, once per batch, whether every one of them has another: for loaders whose
ranks may hold different numbers of batches in an epoch (packed text), and for the training
loop's step vote (a rank whose batch is empty must not skip an all-reduce the others make).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def rank_vote(world_size: int) -> Callable[[list[int]], list[int]] | None:
    """A function every rank calls with the same number of integers and that returns their
    element-wise minimum over ranks (a MIN all-reduce over a gloo group, on the CPU, so it
    never waits on the accelerator). None when there is one rank or no torch.distributed.
    Collective: every rank must build it, in the same order."""
    if world_size == 1:
        return None
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        log.warning("world_size=%d without torch.distributed: the ranks cannot vote (where a "
                    "packed epoch ends, whether a step trains)", world_size)
        return None
    group = dist.new_group(backend="gloo")

    def minimum(values: list[int]) -> list[int]:
        flags = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        return [int(v) for v in flags.tolist()]

    return minimum


def rank_agreement(world_size: int) -> Callable[[bool], bool] | None:
    """For loaders whose ranks may hold different numbers of batches: a function that tells
    every rank whether all ranks have another batch. None when there is one rank."""
    vote = rank_vote(world_size)
    if vote is None:
        return None
    return lambda have: bool(vote([int(have)])[0])
