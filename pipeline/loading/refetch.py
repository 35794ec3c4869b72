"""Fetching a few samples of a shard again, for a resume: the samples still in the shuffle
buffer when the state was saved, from shards the replay otherwise stands in for by counts.

With the shard's `.idx` beside it (make_shards writes one), each member is one range request
for its bytes; without one (or an index that does not list a key), the shard is read through
and the samples picked out, which costs the shard but gives the same samples.
"""

from __future__ import annotations

import logging
from typing import Any

import fsspec

from shardflow.errors import DataError
from shardflow.loading.shardlist import ShardSpec
from shardflow.shards.daliindex import parse_index
from shardflow.shards.tarread import TarLimits, iter_samples, split_name
from shardflow.storage import StorageTimeout, timed
from shardflow.urls import is_remote, redact

log = logging.getLogger(__name__)
Sample = dict[str, object]


def samples_of(spec: ShardSpec, keys: set[str], limits: TarLimits, stats: Any
               ) -> dict[str, Sample]:
    """The samples of `spec` named by `keys`, as the streaming reader's parser gives them."""
    found: dict[str, Sample] = {}
    try:
        with timed("refetching samples by index from", spec.url, spec.storage_options):
            found = _by_index(spec, keys, stats)
    except StorageTimeout:
        raise  # no answer is no sign of a missing index: reading through would wait again
    except (OSError, ValueError) as exc:
        log.info("%s: no usable index (%s); reading the shard for %d samples", redact(spec.url),
                 type(exc).__name__, len(keys))
    if keys - found.keys():
        with timed("refetching samples from", spec.url, spec.storage_options):
            found.update(_by_reading(spec, keys - found.keys(), limits, stats))
    return found


def _by_index(spec: ShardSpec, keys: set[str], stats: Any) -> dict[str, Sample]:
    if not spec.url.endswith(".tar"):
        raise ValueError("not a plain .tar: no index")
    options = dict(spec.storage_options)
    fs, path = fsspec.core.url_to_fs(spec.url, **options)
    with fsspec.open(spec.index_url, "rb", **options) as f:  # beside it, or index=DIR's
        index = f.read().decode()
    wanted = [members for members in parse_index(index)
              if split_name(members[0][3])[0] in keys]
    ranges = [(off, off + size) for members in wanted for _, off, size, _ in members]
    blobs = fs.cat_ranges([path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges])
    if is_remote(spec.url):
        stats.add(remote_bytes=sum(b - a for a, b in ranges))
    found, it = {}, iter(blobs)
    for members in wanted:
        key = split_name(members[0][3])[0]
        sample: Sample = {"__key__": key, "__url__": redact(spec.url)}
        for ext, _off, _size, _name in members:
            data = next(it)
            if isinstance(data, BaseException):
                raise OSError(f"range request failed: {type(data).__name__}") from data
            sample[ext] = data
        found[key] = sample
    return found


def _by_reading(spec: ShardSpec, keys: set[str], limits: TarLimits, stats: Any
                ) -> dict[str, Sample]:
    found: dict[str, Sample] = {}
    with fsspec.open(spec.url, "rb", **spec.storage_options) as f:
        counted = _Counted(f, stats, is_remote(spec.url))
        try:
            for sample in iter_samples(counted, redact(spec.url), limits=limits,  # type: ignore[arg-type]
                                       on_error="skip"):
                if sample["__key__"] in keys:
                    found[str(sample["__key__"])] = sample
                    if len(found) == len(keys):
                        break
        except DataError:
            pass  # what it held before the damage was found; the rest is missing below
    if keys - found.keys():
        raise RuntimeError(f"resuming: {len(keys - found.keys())} samples the saved shuffle "
                           f"buffer held are not in {redact(spec.url)} any more; the shard "
                           "changed since the state was saved")
    return found


class _Counted:
    def __init__(self, f: Any, stats: Any, remote: bool) -> None:
        self.f, self.stats, self.remote = f, stats, remote

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        if self.remote:
            self.stats.add(remote_bytes=len(data))
        return data
