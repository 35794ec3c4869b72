"""Ranks agreeing, once per batch, whether every one of them has another: for loaders whose
ranks may hold different numbers of batches in an epoch (packed text), and for the training
loop's step vote (a rank whose batch is empty must not skip an all-reduce the others make).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def rank_agreement(world_size: int) -> Callable[[bool], bool] | None:
    """For loaders whose ranks may hold different numbers of batches: a function that tells
    every rank whether all ranks have another batch (a MIN all-reduce over a gloo group, on
    the CPU, so it never waits on the accelerator). None when there is one rank. Collective:
    every rank must build its loader, in the same order."""
    if world_size == 1:
        return None
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        log.warning("world_size=%d without torch.distributed: the ranks cannot agree where a "
                    "packed epoch ends, and may run different numbers of batches", world_size)
        return None
    group = dist.new_group(backend="gloo")

    def all_have(have: bool) -> bool:
        flag = torch.tensor([int(have)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return all_have
