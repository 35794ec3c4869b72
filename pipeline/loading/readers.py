"""What every modality's loader shares before decoding: which reader reads the shards, the
local shards' up-front check, the rank defaults and the device.

A modality names the members it reads by extension (`exts`, alternatives in preference
order); both readers return `EncodedBatch`es of those bytes and the `.cls` member.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any, Literal

from pipeline.errors import DataError, OnError, SkipLog, handle
from pipeline.loading import reader_dali, reader_stream
from pipeline.loading.batch import EncodedBatch
from pipeline.loading.options import ReaderKind
from pipeline.loading.readplan import EpochPlan
from pipeline.loading.shardlist import ShardSpec, Source
from pipeline.urls import is_remote

log = logging.getLogger(__name__)


def encoded(reader: str, plan: EpochPlan, state: dict[str, Any] | None, on_error: OnError,
            exts: tuple[str, ...]) -> Iterator[EncodedBatch]:
    """The epoch's encoded batches from `state` on, through the chosen reader."""
    if reader == "dali":
        return reader_dali.batches(plan, state, exts=exts)
    return reader_stream.batches(plan, state, on_error, exts=exts)


def pick_reader(source: Source, reader: ReaderKind, kind: str) -> str:
    """DALI's reader for local shards that all have .idx files, else the streaming reader."""
    if reader not in ("auto", "dali", "stream"):
        raise ValueError(f"reader={reader!r}: choose one of auto, dali, stream")
    local = all(not is_remote(s.url) and s.url.endswith(".tar") and _has_index(s)
                for s in source.shards)
    if reader == "dali" and not local:
        raise ValueError("reader='dali' needs local .tar shards with .idx files beside them; "
                         "use reader='stream' (or 'auto') for remote or unindexed shards")
    chosen = reader if reader != "auto" else ("dali" if local else "stream")
    log.info("%s loader: %s reader for %s", kind, chosen, source.describe())
    return chosen


def _has_index(shard: ShardSpec) -> bool:
    return os.path.isfile(shard.url[: -len(".tar")] + ".idx")  # not a FIFO: opening blocks


def check_local_shards(source: Source, on_error: OnError, skips: SkipLog) -> Source:
    """The shards DALI can read; a truncated or unindexed one is raised or dropped (its
    samples counted as lost) before the epoch is planned, since dropping it changes the plan."""
    good = []
    for shard in source.shards:
        try:
            reader_dali.check_local_shard(shard.url)
            good.append(shard)
        except DataError as err:
            lost = f"; its {shard.samples} samples are lost" if shard.samples else ""
            handle(DataError(err.reason, err.detail + lost, source=err.source,
                             samples=shard.samples), on_error, skips)
    return Source(tuple(good), source.classes, source.modality)


def distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): as given, or torch.distributed's when it is initialised."""
    if rank is None and world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: pass both, with "
                         "0 <= rank < world_size")
    return rank, world_size


def resolve_device(device: str, kind: str) -> tuple[Literal["cpu", "gpu"], int | None]:
    """Where a loader works and puts its batches, and on a GPU the CUDA index, read in the
    calling thread (the current device is per thread: under torchrun each rank set its own)."""
    import torch

    if device == "gpu" and not torch.cuda.is_available():
        raise ValueError("device='gpu' but CUDA is not available here; use device='cpu' or "
                         "'auto'")
    gpu = device == "gpu" or (device == "auto" and torch.cuda.is_available())
    log.info("%s loader: on the %s (device=%r)", kind, "gpu" if gpu else "cpu", device)
    return ("gpu", torch.cuda.current_device()) if gpu else ("cpu", None)
