"""The shard list: what a source names, in which order each epoch, and which part a rank reads.

    source (folder with manifest.json | glob | brace pattern | list | URL)
      -> [ShardSpec(url, samples)]            resolve_source(): missing shards reported all at once
      -> epoch_order(seed, epoch)             a permutation drawn from (seed, epoch) only
      -> split_ranks(world_size)              balanced by sample counts, disjoint, covering
      -> even_length()                        every rank reads the same number of samples

Counts come from manifest.json, else from the DALI index beside each local shard; without
either, a source can be read by one rank only (there is nothing to balance ranks with).
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from shardflow.shards import indexdir
from shardflow.shards.listing import count_from_index, exists, list_shards, preflight, unlisted
from shardflow.shards.manifest import MANIFEST, TokenForm, load_manifest
from shardflow.storage import check_storage_options, timed, with_timeouts
from shardflow.urls import beside, check_scheme, expand_braces, redact

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSpec:
    url: str
    samples: int | None = None  # None: not known before reading
    sha256: str | None = None  # from manifest.json, when there is one
    # fsspec's keyword arguments to open `url` (endpoint, credentials): one mapping shared by
    # a source's shards; never shown, compared or saved
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False,
                                               compare=False)
    # Its DALI index, when not beside it (an index folder: pipeline/shards/indexdir.py)
    index: str | None = None

    @property
    def index_url(self) -> str:
        """Where this shard's `.idx` lies (it may not exist)."""
        return self.index or beside(self.url, ".idx")


@dataclass(frozen=True)
class Source:
    """Resolved shards, plus what the manifest says about them when there is one."""

    shards: tuple[ShardSpec, ...]
    classes: dict[str, int] | None = None
    modality: str | None = None
    tokens: TokenForm | None = None  # text stored as token ids (pipeline/text/pretokenized.py)
    # scenes labelled per point: the manifest's classes, ignore label, counts (segstats.py)
    segmentation: dict[str, Any] | None = None
    # tabular rows: the manifest's schema and counts of the whole dataset (tabular/schema.py)
    tabular: dict[str, Any] | None = None

    @property
    def total(self) -> int | None:
        counts = [s.samples for s in self.shards if s.samples is not None]
        return sum(counts) if len(counts) == len(self.shards) else None

    def fingerprint(self) -> str:
        """A hash of every shard's name, count and checksum (when the manifest gives it) and
        of the class map: equal for the same dataset, wherever it lies."""
        import hashlib
        import json

        # Names, not full paths: a dataset moved to another folder or bucket is the same one.
        text = "\n".join(f"{s.url.rsplit('/', 1)[-1]} {s.samples} {s.sha256}"
                         for s in self.shards)
        text += json.dumps(self.classes, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """A credential-free name for logs, errors and state dicts: the shards' folder where
        they share one, else the first shard."""
        if not self.shards:
            return "0 shards"
        folders = {s.url.rsplit("/", 1)[0] for s in self.shards if "/" in s.url}
        if len(folders) == 1 and all("/" in s.url for s in self.shards):
            return f"{len(self.shards)} shards in {redact(folders.pop())}/"
        return f"{len(self.shards)} shards from {redact(self.shards[0].url)}"


def resolve_source(source: str | Path | Sequence[str] | Source, *, allow_pipe: bool = False,
                   storage_options: Mapping[str, Any] | None = None,
                   index: str | Path | None = None, io_timeout_s: float | None = None
                   ) -> Source:
    """Resolve any accepted form of `source`; FileNotFoundError lists every missing shard.
    `storage_options`: fsspec's keyword arguments for its URLs, kept with each shard, with
    the connect and read timeouts of `io_timeout_s` seconds added (None: storage.py's
    defaults; a server that does not answer in time raises storage.StorageTimeout).
    `index`: a folder holding the shards' manifest and .idx files (shards/indexdir.py).
    A `Source` (resolved already, perhaps split: a held-out part, a rank's share) is
    returned as it is."""
    if isinstance(source, Source):
        return _resolved(source, storage_options, index, io_timeout_s)
    check_storage_options(storage_options)
    named = [str(source)] if isinstance(source, (str, Path)) else [str(u) for u in source]
    options = with_timeouts(storage_options, *named, *([str(index)] if index else []),
                            seconds=io_timeout_s)
    if index is not None:
        return _from_index_dir(source, str(index), options)
    if isinstance(source, (str, Path)):
        text = str(source)
        found = _from_manifest(text, options)
        if found is not None:
            return found
        urls = list_shards(text, options) if not text.startswith("pipe:") else [text]
        for err in unlisted(text, urls):  # read by no loader: said, not passed over in silence
            log.warning("%s: %s [%s]", err.source, err.detail, err.reason)
    else:
        urls = [u for item in source for u in expand_braces(str(item))]
    for url in urls:
        check_scheme(url, allow_pipe=allow_pipe)
    preflight(urls, str(source), options)
    return Source(tuple(ShardSpec(u, count_from_index(u), storage_options=options)
                        for u in urls))


def _resolved(source: Source, storage_options: Mapping[str, Any] | None,
              index: str | Path | None, io_timeout_s: float | None) -> Source:
    # Refused rather than ignored: they were the resolver's to use, and a Source keeps
    # what it was resolved with (each shard's storage options, timeouts and .idx place).
    if storage_options or index is not None or io_timeout_s is not None:
        raise ValueError(f"{source.describe()} is resolved already: pass storage_options, "
                         "io_timeout_s and index to resolve_source, which keeps them with "
                         "each shard")
    return source


def _from_manifest(text: str, options: Mapping[str, Any]) -> Source | None:
    base = text.rstrip("/")
    if base.endswith(".json"):
        manifest_url, base = base, base.rsplit("/", 1)[0]
    else:
        manifest_url = f"{base}/{MANIFEST}"
    if not exists(manifest_url, options):
        return None
    with timed("reading the manifest", manifest_url, options):
        m = load_manifest(manifest_url, options)
    shards = tuple(ShardSpec(f"{base}/{s.name}", s.samples, s.sha256, options)
                   for s in m.shards)
    preflight([s.url for s in shards], text, options)
    return Source(shards, m.classes, m.modality, m.tokens, m.segmentation, m.tabular)


def _from_index_dir(source: str | Path | Sequence[str], index: str,
                    options: dict[str, Any]) -> Source:
    given = str(source) if isinstance(source, (str, Path)) else source
    found, m = indexdir.matched(given, index, options)
    shards = tuple(ShardSpec(url, info.samples, info.sha256, options,
                             indexdir.index_path(url, index)) for url, info in found)
    for s in shards:
        check_scheme(s.url)
    preflight([s.url for s in shards], str(source), options)
    return Source(shards, m.classes, m.modality, m.tokens, m.segmentation, m.tabular)


def epoch_order(shards: Iterable[T], seed: int, epoch: int, shuffle: bool) -> list[T]:
    """This epoch's shard order: a permutation drawn from (seed, epoch) alone (the same for
    the shards as for their indices: it depends only on how many there are)."""
    order = list(shards)
    if shuffle:
        random.Random(f"shards/{seed}/{epoch}").shuffle(order)
    return order


def split_ranks(shards: Sequence[ShardSpec], world_size: int) -> list[list[ShardSpec]]:
    """Disjoint shard lists, one per rank, covering all shards, balanced by sample count.

    Greedy: each shard in turn goes to the rank holding the fewest samples so far, which keeps
    ranks within one shard's worth of samples of each other and preserves the epoch order.
    """
    if world_size > len(shards):
        raise ValueError(f"{len(shards)} shards cannot feed {world_size} ranks: every rank needs"
                         " at least one shard; re-shard with a smaller --max-count or use fewer "
                         "ranks")
    if world_size > 1 and any(s.samples is None for s in shards):
        raise ValueError("splitting shards over ranks needs their sample counts: read a folder "
                         "with manifest.json (or local shards with .idx files)")
    ranks: list[list[ShardSpec]] = [[] for _ in range(world_size)]
    heap = [(0, r) for r in range(world_size)]
    for shard in shards:
        load, r = heapq.heappop(heap)
        ranks[r].append(shard)
        heapq.heappush(heap, (load + (shard.samples or 0), r))
    return ranks


def even_length(per_rank: Sequence[Sequence[ShardSpec]]) -> tuple[int | None, int]:
    """Samples every rank reads this epoch (the smallest rank's count), and how many samples
    all ranks together drop to get there. (None, 0) when counts are unknown (one rank)."""
    counts = [sum(s.samples or 0 for s in rank) for rank in per_rank]
    if any(s.samples is None for rank in per_rank for s in rank):
        return None, 0
    length = min(counts)
    return length, sum(counts) - length * len(counts)
