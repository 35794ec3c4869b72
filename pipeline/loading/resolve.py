"""What a loader is built on, decided once: the backend, where batches land and where they are
decoded, the reader, and the shards DALI's reader can open. Every loader's constructor calls
`resolve` (through Loader._init_from_config) and keeps what it returns; nothing re-derives it.

    resolve(kind, source, cfg, rank, world_size, gpu_decode)
      -> the modality of the shards checked (the wrong loader is refused at build)
      -> backend: "dali" or "portable" (cfg.backend; "auto": DALI where it imports)
      -> placement: device and decode ("auto": CUDA where it is, decode on it where the
         backend and modality can)
      -> reader: DALI's, the index reader or streaming (readers.pick_reader)
      -> for DALI's and the index reader, each local shard checked: a bad one is raised or
         dropped before the epoch is planned (dropping it changes the plan)

The factories (`image_loader` and the others) settle the options before this, from the
caller's and a tuning file's (loading/tuning.py, settled.py, image/choose.py for the image
backend on large photos), and the ranks (readers.distributed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from shardflow.errors import SkipLog
from shardflow.loading import readers
from shardflow.loading.readers import Placement
from shardflow.loading.shardlist import Source
from shardflow.samples.checks import TEXT_EXTS, TOKEN_EXTS, modality_of
from shardflow.urls import is_remote

_LOADER_OF = {"image": "image_loader", "text": "text_loader", "pointcloud": "pointcloud_loader",
              "tabular": "tabular_loader"}


@dataclass(frozen=True)
class Resolved:
    """A loader's build-time decisions (see the module docstring)."""

    source: Source  # without the local shards DALI's reader cannot open (when skipped)
    backend: str  # "dali" or "portable"
    placement: Placement
    reader: str  # "dali", "index" or "stream"
    dropped: list[dict[str, Any]] = field(default_factory=list)  # those shards' skips


def resolve(kind: str, source: Source, cfg: Any, gpu_decode: bool) -> Resolved:
    """The decisions for a `kind` loader with options `cfg` (LoaderOptions) on `source`;
    `gpu_decode`: whether this modality can decode on a GPU (on the DALI backend)."""
    check_modality(source, kind)
    backend = readers.resolve_backend(cfg.backend, kind, cfg.decode)
    placement = readers.resolve_placement(cfg.device, cfg.decode, kind,
                                          gpu_decode=gpu_decode and backend == "dali")
    reader = readers.pick_reader(source, cfg.reader, kind, backend)
    dropped = SkipLog()
    if reader in ("dali", "index"):
        source = readers.check_local_shards(source, cfg.on_error, dropped)
    return Resolved(source, backend, placement, reader, dropped.entries)


def check_modality(source: Source, kind: str) -> None:
    """Shards of another modality are refused at build: read, every sample would fail alone
    as a missing member, which does not say that the loader is the wrong one. The same
    shards get the same answer however they are named (a folder with its manifest, a
    pattern): the manifest's modality, else the first sample's members in its local index.
    Captions beside images are text, which text_loader reads."""
    held = _first_members(source)
    if kind == "text" and held is not None and held & {*TEXT_EXTS, *TOKEN_EXTS}:
        return
    modality = source.modality or (modality_of(held) if held else None)
    if modality in _LOADER_OF and kind in _LOADER_OF and modality != kind:
        said = "manifest.json's modality" if source.modality else "their members"
        raise ValueError(f"these shards hold {modality} ({said}), not {kind}: read them with "
                         f"{_LOADER_OF[modality]}")


def _first_members(source: Source) -> set[str] | None:
    """The extensions of the first shard's first sample, from its local .idx; None where
    there is none to read (remote or unindexed shards: the samples then say it)."""
    for shard in source.shards[:1]:
        if shard.samples == 0 or is_remote(shard.index_url) \
                or not os.path.isfile(shard.index_url):  # not a FIFO: opening blocks
            return None
        try:
            with open(shard.index_url) as f:
                f.readline()  # "v1.2 N"
                fields = f.readline().split()
        except OSError:
            return None
        return {ext.lower() for ext in fields[0::4]} or None
    return None
