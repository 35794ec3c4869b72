"""Random access to a shard set by global index or key: a map-style dataset over the shards'
`.idx` offsets (what wids' ShardListDataset and Streaming's `dataset[i]` give).

    from shardflow import ShardDataset
    ds = ShardDataset("shards/images")          # local, https://, s3:// (storage_options=...)
    ds = ShardDataset(url, io_timeout_s=10)     # a server silent for 10 s: StorageTimeout
    len(ds); ds[17]; ds.key(17); ds.get("class_3_00012"); ds.keys()
    # {"__key__": ..., "__url__": ..., "image": uint8 (H, W, 3), "label": 3, ...}

A global index counts samples in the source's shard order (the manifest's), each shard's in
its index's order. Only the shards' indexes are read up front (the counts in the manifest
give `len` without even those); a sample is one read of its members' span: `os.pread` on a
local shard (or its copy in the shard cache), one range request on a remote one. No state
is shared between reads and files are opened per process, so the dataset is safe in
DataLoader worker processes, with any sampler. Decoding uses the loaders' own checks
(access/decode.py); `decode=False` gives the raw members. A bad sample raises DataError
naming its shard and key; with on_error="skip" it is logged, counted in `skipped` (this
process's) and returned as None, which `collate_skipping` leaves out of a batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import operator
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.access.decode import MAX_PIXELS, decoded
from shardflow.errors import DataError, OnError, SkipLog, check_on_error, handle
from shardflow.loading.shardcache import ShardCache
from shardflow.loading.shardlist import ShardSpec, Source, resolve_source
from shardflow.samples.checks import modality_of
from shardflow.shards.daliindex import parse_index
from shardflow.shards.tarread import split_name
from shardflow.storage import timed
from shardflow.urls import is_remote, redact

log = logging.getLogger(__name__)
Members = list[tuple[str, int, int, str]]  # ext, offset, size, member name
OPEN_FILES = 64  # local shards held open per process


class ShardDataset:
    """Samples of a shard set by global index or key (see the module's docs)."""

    def __init__(self, source: str | Path | Sequence[str], *, decode: bool = True,
                 on_error: OnError = "raise", storage_options: Mapping[str, Any] | None = None,
                 index: str | Path | None = None, cache_dir: str | Path | None = None,
                 max_pixels: int = MAX_PIXELS, io_timeout_s: float | None = None) -> None:
        check_on_error(on_error)
        # io_timeout_s: a server silent this long (None: storage.READ_TIMEOUT_S) raises
        # StorageTimeout naming the URL, here and at every read
        self.source: Source = resolve_source(source, storage_options=storage_options,
                                             index=index, io_timeout_s=io_timeout_s)
        self.decode, self.on_error, self.max_pixels = decode, on_error, max_pixels
        self.cache = ShardCache(cache_dir, 2**62) if cache_dir else None
        self.skipped = SkipLog()
        self._tables: dict[int, list[Members]] = {}
        self._keys: dict[str, tuple[int, int]] | None = None
        self._ends = self._counted()
        if self.source.modality is None:
            self.source = dataclasses.replace(self.source, modality=self._members_say())
        # shard -> fd, opened in this process, at most OPEN_FILES (least recently used closed)
        self._files: OrderedDict[int, int] = OrderedDict()
        self._pid = os.getpid()

    # -- what is in it -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def key(self, i: int) -> str:
        shard, row = self._locate(i)
        return split_name(self._table(shard)[row][0][3])[0]

    def keys(self) -> list[str]:
        """Every key, in global index order (reads every shard's index)."""
        return [split_name(members[0][3])[0] for shard in range(len(self.source.shards))
                for members in self._table(shard)]

    def index_of(self, key: str) -> int:
        """The global index of `key`; KeyError naming the source when it is not there."""
        shard, row = self._by_key(key)
        return (self._ends[shard - 1] if shard else 0) + row

    # -- reading -------------------------------------------------------------------------------

    def __getitem__(self, i: int) -> dict[str, Any] | None:
        shard, row = self._locate(i)
        return self._read(shard, row, self.decode)

    def get(self, key: str) -> dict[str, Any] | None:
        return self._read(*self._by_key(key), self.decode)

    def raw(self, i: int) -> dict[str, Any] | None:
        """Sample `i`'s members as bytes, whatever `decode` says."""
        return self._read(*self._locate(i), False)

    def close(self) -> None:
        """Close the shards this process opened (reads open them again as needed)."""
        while self._files:
            os.close(self._files.popitem()[1])

    def __enter__(self) -> ShardDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if os.getpid() == getattr(self, "_pid", None):
            self.close()

    def __iter__(self) -> Iterator[dict[str, Any] | None]:
        return (self[i] for i in range(len(self)))

    def _read(self, shard: int, row: int, decode: bool) -> dict[str, Any] | None:
        spec, members = self.source.shards[shard], self._table(shard)[row]
        key = split_name(members[0][3])[0]
        sample: dict[str, Any] = {"__key__": key, "__url__": redact(spec.url)}
        try:
            sample.update(self._members(shard, members))
            if not decode:
                return sample
            classes = len(self.source.classes) if self.source.classes else None
            return decoded(sample, self.source.modality, self.source.tokens, classes,
                           self.max_pixels, self.source.segmentation)
        except DataError as err:
            handle(err.located(source=redact(spec.url), key=key), self.on_error,
                   self.skipped)
            return None

    def _members(self, shard: int, members: Members) -> dict[str, bytes]:
        """The sample's members in one read of their span (they lie together in the tar,
        headers between)."""
        start = min(off for _, off, _, _ in members)
        end = max(off + size for _, off, size, _ in members)
        span = self._span(shard, start, end)
        if len(span) != end - start:
            raise DataError("truncated", f"the shard ends before byte {end} its index points "
                            "to: it was cut or replaced after indexing")
        return {ext: span[off - start: off - start + size] for ext, off, size, _ in members}

    def _span(self, shard: int, start: int, end: int) -> bytes:
        spec = self.source.shards[shard]
        local = self._local_path(spec)
        if local is None:
            import fsspec

            fs, path = fsspec.core.url_to_fs(spec.url, **spec.storage_options)
            with timed("reading shard", spec.url, spec.storage_options):
                (found,) = fs.cat_ranges([path], [start], [end])
                if isinstance(found, BaseException):
                    raise OSError(f"range request to {redact(spec.url)} failed: {found}") \
                        from found
            if len(found) > end - start:  # the server sent the whole shard, not the range
                self._warn_no_ranges(spec)
                found = found[start:end]
            return bytes(found)
        if os.getpid() != self._pid:  # a forked DataLoader worker: its own files
            self._files, self._pid = OrderedDict(), os.getpid()
        fd = self._files.get(shard)
        if fd is None:
            fd = self._files[shard] = os.open(local, os.O_RDONLY)
            while len(self._files) > OPEN_FILES:
                os.close(self._files.popitem(last=False)[1])
        self._files.move_to_end(shard)
        return os.pread(fd, end - start, start)

    def _warn_no_ranges(self, spec: ShardSpec) -> None:
        if not getattr(self, "_warned", False):
            self._warned = True
            log.warning("%s: the server does not answer range requests; every sample read "
                        "fetches its whole shard (use shards on a server that does, or a "
                        "local copy)", redact(spec.url))

    def _local_path(self, spec: ShardSpec) -> str | None:
        if not is_remote(spec.url):
            return spec.url
        cached = self.cache.lookup(spec) if self.cache is not None else None
        return str(cached) if cached is not None else None

    # -- the indexes ---------------------------------------------------------------------------

    def _members_say(self) -> str | None:
        """Without a manifest (a shard given by its path, a list of URLs), the modality its
        first samples' members name (checks.modality_of), so that an image is decoded and
        checked, not handed back as bytes; None when they name none."""
        exts = {ext for members in (self._table(0)[:16] if self.source.shards else [])
                for ext, _, _, _ in members}
        found = modality_of(exts)
        if found == "unknown":
            return None
        log.info("%s: no manifest; its members are read as %s", self.source.describe(), found)
        return found

    def _counted(self) -> list[int]:
        """Cumulative sample counts by shard: the manifest's, else each index's."""
        ends, total = [], 0
        for shard, spec in enumerate(self.source.shards):
            total += spec.samples if spec.samples is not None else len(self._table(shard))
            ends.append(total)
        return ends

    def _locate(self, i: int) -> tuple[int, int]:
        n = len(self)
        if isinstance(i, bool):
            raise TypeError(f"index {i!r}: an int (use get(key) for a key)")
        try:
            i = operator.index(i)  # numpy integers too (a sampler's indexes)
        except TypeError:
            raise TypeError(f"index {i!r}: an int (use get(key) for a key)") from None
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range: {self.source.describe()} holds {n} "
                             "samples")
        i %= n
        shard = bisect.bisect_right(self._ends, i)
        return shard, i - (self._ends[shard - 1] if shard else 0)

    def _by_key(self, key: str) -> tuple[int, int]:
        if self._keys is None:
            self._keys = {split_name(members[0][3])[0]: (shard, row)
                          for shard in range(len(self.source.shards))
                          for row, members in enumerate(self._table(shard))}
        found = self._keys.get(key)
        if found is None:
            raise KeyError(f"no sample with key {key!r} in {self.source.describe()}")
        return found

    def _table(self, shard: int) -> list[Members]:
        table = self._tables.get(shard)
        if table is None:
            table = self._tables[shard] = _read_index(self.source.shards[shard])
        return table

    def __getstate__(self) -> dict[str, Any]:
        # Open files stay with the process that opened them (DataLoader workers reopen).
        return {**self.__dict__, "_files": OrderedDict()}


def _read_index(spec: ShardSpec) -> list[Members]:
    import fsspec

    local = None if is_remote(spec.index_url) else spec.index_url.removeprefix("file://")
    if local is not None and os.path.exists(local) and not os.path.isfile(local):
        raise DataError("bad-index", f"{redact(spec.index_url)} is not a regular file (opening "
                        "a FIFO blocks until a writer comes)", source=redact(spec.url))
    try:  # a timeout is StorageTimeout (no FileNotFoundError: the index may be there)
        with timed("reading the index", spec.index_url, spec.storage_options), \
                fsspec.open(spec.index_url, "rb", **spec.storage_options) as f:
            text = f.read().decode()
    except FileNotFoundError:
        raise DataError("missing-index", f"no index at {redact(spec.index_url)}: "
                        f"{_index_advice(spec.url)}", source=redact(spec.url)) from None
    try:
        table = parse_index(text)
    except ValueError as exc:
        raise DataError("bad-index", f"{redact(spec.index_url)}: {exc}",
                        source=redact(spec.url)) from None
    if spec.samples is not None and len(table) != spec.samples:
        raise DataError("index-mismatch", f"the index lists {len(table)} samples, the manifest "
                        f"{spec.samples}", source=redact(spec.url))
    return table


def collate_skipping(samples: list[Any]) -> Any:
    """torch's default_collate of the samples that are not None (skipped as bad). An array
    whose shape differs between samples (photos of their own sizes, clouds of their own
    point counts) cannot stack: it comes as a list of tensors, one per sample."""
    import torch
    from torch.utils.data import default_collate

    kept = [s for s in samples if s is not None]
    if not kept or not isinstance(kept[0], dict):
        return default_collate(kept)
    ragged = [k for k, v in kept[0].items() if isinstance(v, np.ndarray)
              and len({np.shape(s[k]) for s in kept}) > 1]
    batch = default_collate([{k: v for k, v in s.items() if k not in ragged} for s in kept])
    for k in ragged:
        batch[k] = [torch.as_tensor(s[k]) for s in kept]
    return batch


def _index_advice(url: str) -> str:
    """What makes an index for this shard: `shardflow index` reads members at their offsets
    in a plain tar, so it refuses a gzipped shard, which a rewrite unpacks."""
    if url.endswith((".tar.gz", ".tgz")):
        return ("a gzipped shard has none (members lie at offsets of a plain tar): "
                "`shardflow convert shards SRC DST` rewrites it as plain tar, with indexes")
    return ("make one with `shardflow index SRC` (--out DIR for shards you cannot write "
            "beside, then index=DIR)")
