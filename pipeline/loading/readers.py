"""What every modality's loader shares before decoding: which reader reads the shards, the
local shards' up-front check, the rank defaults and the device.

A modality names the members it reads by extension (`exts`, alternatives in preference
order); both readers return `EncodedBatch`es of those bytes and the `.cls` member.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

from shardflow import dali
from shardflow.errors import DataError, OnError, SkipLog, handle
from shardflow.loading import consumed, reader_dali, reader_index, reader_stream
from shardflow.loading.batch import EncodedBatch
from shardflow.loading.options import Backend, ReaderKind, portable_conflict
from shardflow.loading.readplan import EpochPlan
from shardflow.loading.shardlist import ShardSpec, Source
from shardflow.urls import is_remote

log = logging.getLogger(__name__)


def encoded(reader: str, plan: EpochPlan, state: dict[str, Any] | None, on_error: OnError,
            exts: tuple[str, ...], extras: tuple[str, ...] = (),
            stream: reader_stream.StreamOptions | None = None,
            primed: reader_dali.Primed | None = None,
            then: Callable[[], EpochPlan] | None = None, views: bool = True
            ) -> Iterator[EncodedBatch]:
    """The epoch's encoded batches from `state` on, through the chosen reader; `extras`:
    further members to carry by extension (EncodedBatch.extras). Each batch's state says
    what was read up to it (consumed.py). The rest of an epoch resumed on another number of
    ranks is streamed whatever the reader: it passes over keys read before, which DALI's
    reader cannot. `stream`: how the streaming reader fetches (shards in flight, cache).
    DALI's reader: `primed` may hold the pipeline started for this plan, and once every batch
    is read, the one of `then()` (the next pass's plan) is started there. The index reader
    (reader_index.py) reads local indexed shards with numpy, no pipeline; `views=False`: it
    leaves the data column as one buffer (EncodedBatch.flat, unpack)."""
    if reader == "index" and not plan.rest:
        found = reader_index.batches(plan, state, exts=exts, extras=extras, views=views)
    elif reader == "dali" and not plan.rest:
        found = reader_dali.batches(plan, state, exts=exts, extras=extras, primed=primed)
        if primed is not None and then is not None:
            found = _then_prime(found, primed, then, exts, extras)
    else:
        found = reader_stream.batches(plan, state, on_error, exts=exts, extras=extras,
                                      options=stream)
    return consumed.follow(found, plan, state)


def _then_prime(batches: Iterator[EncodedBatch], primed: reader_dali.Primed,
                then: Callable[[], EpochPlan], exts: tuple[str, ...], extras: tuple[str, ...]
                ) -> Iterator[EncodedBatch]:
    yield from batches
    # Reached only when the epoch was read whole (not when its pass was left early). A
    # speed-up, so its failure is not this epoch's: that epoch's own pass meets it again.
    try:
        primed.start(then(), exts, extras)
    except (ValueError, OSError, RuntimeError) as exc:  # a bad split, a file, DALI itself
        log.warning("the next epoch's reader was not started ahead: %s", exc)


def pick_reader(source: Source, reader: ReaderKind, kind: str, backend: str = "dali") -> str:
    """DALI's reader for local shards that all have .idx files, else the streaming reader
    (which reads local shards too); the portable backend streams. Stored token ids on local
    indexed shards: the index reader, on either backend (DALI's reader cost more than the
    rest of such a loader: loading/reader_index.py); reader="index" asks for it anywhere."""
    if reader not in ("auto", "dali", "stream", "index"):
        raise ValueError(f"reader={reader!r}: choose one of auto, dali, stream, index")
    local = dali_readable(source)
    if reader == "index" or (reader == "auto" and local and source.tokens is not None):
        if not local:
            raise ValueError("reader='index' needs local .tar shards with .idx files (beside "
                             "them, or in a folder given as index=DIR); use reader='stream' "
                             "(or 'auto') for remote or unindexed shards")
        log.info("%s loader: index reader for %s", kind, source.describe())
        return "index"
    if backend == "portable":
        if reader == "dali":
            raise ValueError(portable_conflict(reader, "auto", " (nvidia.dali does not import)"))
        log.info("%s loader: stream reader for %s (portable backend)", kind, source.describe())
        return "stream"
    if reader == "dali" and not local:
        raise ValueError("reader='dali' needs local .tar shards with .idx files (beside them, "
                         f"or in a folder given as index=DIR), which {_not_dali(source)} are "
                         "not; use reader='stream' (or 'auto') for remote or unindexed shards")
    chosen = reader if reader != "auto" else ("dali" if local else "stream")
    log.info("%s loader: %s reader for %s", kind, chosen, source.describe())
    return chosen


@functools.cache
def dali_importable() -> bool:
    """Whether nvidia.dali imports here (asked once per process: the import takes a second)."""
    try:
        import nvidia.dali  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: a wheel whose CUDA libraries are missing
        log.debug("nvidia.dali does not import: %s", exc)
        return False
    return True


def resolve_backend(backend: str, kind: str, decode: str = "auto") -> Backend:
    """`backend` as given, or "auto" resolved (DALI where it imports, else portable); the
    first resolution of "auto" is logged once per process. ImportError for "dali" without
    DALI; ValueError for decode="gpu" on the portable backend, naming both options."""
    if backend not in ("auto", "dali", "portable"):
        raise ValueError(f"backend={backend!r}: choose one of auto, dali, portable")
    if backend == "dali" and not dali_importable():
        raise ImportError("backend='dali' but nvidia.dali does not import here: install it "
                          f"({dali.install_hint()}, Linux only), or use "
                          "backend='portable' (or 'auto')")
    chosen = _auto_backend() if backend == "auto" else cast(Backend, backend)
    if chosen == "portable" and decode == "gpu":
        why = "" if backend == "portable" else " (backend='auto': nvidia.dali does not import)"
        raise ValueError(portable_conflict("auto", decode, why))
    return chosen


@functools.cache
def _auto_backend() -> Backend:
    if dali_importable():
        log.info("backend='auto': DALI (nvidia.dali imports); backend='portable' runs without it")
        return "dali"
    log.info("backend='auto': portable (PIL/numpy + torch on the CPU, streaming reader): "
             "nvidia.dali does not import here")
    return "portable"


def dali_readable(source: Source) -> bool:
    """Whether DALI's reader can read `source`: local .tar shards, each with its .idx."""
    return all(_dali_reads(s) for s in source.shards)


def _dali_reads(shard: ShardSpec) -> bool:
    return not is_remote(shard.url) and shard.url.endswith(".tar") and _has_index(shard)


def _not_dali(source: Source) -> str:
    """The shards DALI's reader cannot read, named (the first five)."""
    names = [s.url.rsplit("/", 1)[-1] for s in source.shards if not _dali_reads(s)]
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _has_index(shard: ShardSpec) -> bool:
    return os.path.isfile(shard.index_url)  # not a FIFO: opening blocks


def check_local_shards(source: Source, on_error: OnError, skips: SkipLog) -> Source:
    """The shards DALI can read; a truncated or unindexed one is raised or dropped (its
    samples counted as lost) before the epoch is planned, since dropping it changes the plan."""
    good = []
    for shard in source.shards:
        try:
            reader_dali.check_local_shard(shard.url, shard.index_url)
            good.append(shard)
        except DataError as err:
            lost = f"; its {shard.samples} samples are lost" if shard.samples else ""
            handle(DataError(err.reason, err.detail + lost, source=err.source,
                             samples=shard.samples), on_error, skips)
    return replace(source, shards=tuple(good))


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


@dataclass(frozen=True)
class Placement:
    """Where a loader's batches land (`target`, `cuda_index`) and where it decodes and
    augments (`decode`): resolved once, at build time, and logged."""

    target: Literal["cpu", "cuda"]
    cuda_index: int | None
    decode: Literal["cpu", "gpu"]

    @property
    def device(self) -> str:
        """The batches' torch device, e.g. "cpu" or "cuda:0"."""
        return "cpu" if self.target == "cpu" else f"cuda:{self.cuda_index}"


def resolve_placement(device: str, decode: str, kind: str, gpu_decode: bool) -> Placement:
    """`device`/`decode` as given, or "auto" resolved from what is here; `gpu_decode`: whether
    this modality can decode on a GPU. The CUDA index is read in the calling thread (the
    current device is per thread: under torchrun each rank set its own)."""
    import torch

    wants_cuda = device in ("gpu", "cuda") or device.startswith("cuda:")
    if wants_cuda and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu' "
                         "or 'auto'")
    on_cuda = wants_cuda or (device == "auto" and torch.cuda.is_available())
    if decode == "gpu" and not on_cuda:
        raise ValueError("decode='gpu' puts batches on the GPU: use device='cuda' (or 'auto' "
                         "on a machine with CUDA), or decode='cpu'")
    if decode == "gpu" and not gpu_decode:
        raise ValueError(f"decode='gpu': the {kind} loader prepares batches on the CPU only; "
                         "use decode='cpu' (batches still land on device)")
    index = None
    if on_cuda:
        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
    where = decode if decode != "auto" else ("gpu" if on_cuda and gpu_decode else "cpu")
    placement = Placement("cuda" if on_cuda else "cpu", index, where)  # type: ignore[arg-type]
    log.info("%s loader: decodes on the %s, batches on %s (device=%r, decode=%r)", kind,
             where, placement.device, device, decode)
    return placement
