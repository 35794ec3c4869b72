"""Reading tar shards safely, as a stream of samples.

Members are grouped into samples by key (the member name up to the first dot of its base
name), as webdataset and DALI do. Member names are only ever used as keys, never as
file-system paths; links, devices and names that climb out (`../`, `/abs`) are refused, and so
is a member that declares more bytes than `max_member_bytes`, before anything is allocated.
A key seen twice in one shard (duplicated, or its members not next to each other) is an error.
"""

from __future__ import annotations

import posixpath
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from pipeline.errors import DataError, OnError, SkipLog, handle

Sample = dict[str, object]
DEFAULT_MAX_MEMBER_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class TarLimits:
    """Bounds on what one shard may make us read into memory."""

    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES

    def __post_init__(self) -> None:
        if self.max_member_bytes <= 0:
            raise ValueError(f"max_member_bytes={self.max_member_bytes}: must be > 0")


def split_name(name: str) -> tuple[str, str]:
    """`dir/abc.seg.jpg` -> (`dir/abc`, `seg.jpg`): the key ends at the first dot of the base."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1:]


def _check_member(info: tarfile.TarInfo, url: str, limits: TarLimits) -> None:
    key = split_name(info.name)[0]
    if not info.isreg():
        raise DataError("not-a-regular-file", f"member {info.name!r} is a link, device or "
                        "directory; shards hold regular files only", source=url, key=key)
    parts = info.name.split("/")
    if info.name.startswith("/") or ".." in parts or posixpath.isabs(info.name):
        raise DataError("unsafe-member-name", f"member name {info.name!r} is absolute or "
                        "climbs out with '..'", source=url, key=key)
    if info.size > limits.max_member_bytes:
        raise DataError("member-too-large", f"member {info.name!r} declares {info.size} bytes, "
                        f"more than max_member_bytes={limits.max_member_bytes}",
                        source=url, key=key)
    if not split_name(info.name)[1] or not key or key.endswith("/"):
        raise DataError("no-extension", f"member {info.name!r} has no key.extension form",
                        source=url, key=key)


def iter_members(stream: BinaryIO, url: str, limits: TarLimits, on_error: OnError,
                 skips: SkipLog) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each acceptable member, in archive order; shard-level damage raises."""
    try:
        tar = tarfile.open(fileobj=stream, mode="r|*")  # type: ignore[call-overload]
    except tarfile.ReadError as exc:
        raise _open_error(stream, url, exc) from None
    with tar:
        try:
            for info in tar:
                try:
                    _check_member(info, url, limits)
                except DataError as err:
                    handle(err, on_error, skips)
                    continue
                yield info.name, _read_member(tar, info, url)
        except (tarfile.ReadError, EOFError) as exc:
            raise DataError("truncated", f"tar structure ends or breaks early ({exc})",
                            source=url) from None


def _read_member(tar: tarfile.TarFile, info: tarfile.TarInfo, url: str) -> bytes:
    f = tar.extractfile(info)
    assert f is not None  # regular files always have data
    data = f.read()
    if len(data) != info.size:
        raise DataError("truncated", f"member {info.name!r} is cut short: {len(data)} of "
                        f"{info.size} bytes", source=url, key=split_name(info.name)[0])
    return data


def _open_error(stream: BinaryIO, url: str, exc: Exception) -> DataError:
    if "empty" in str(exc):
        return DataError("empty-shard", "the file is empty (0 bytes)", source=url)
    return DataError("not-a-tar", f"not a tar archive ({exc}); an HTML error page saved as "
                     ".tar looks like this", source=url)


def iter_samples(stream: BinaryIO, url: str, *, limits: TarLimits | None = None,
                 on_error: OnError = "raise", skips: SkipLog | None = None) -> Iterator[Sample]:
    """Samples (`__key__`, `__url__`, ext -> bytes) of one shard, in archive order."""
    limits, skips = limits or TarLimits(), skips if skips is not None else SkipLog()
    grouper = _Grouper(url, on_error, skips)
    for name, data in iter_members(stream, url, limits, on_error, skips):
        done = grouper.add(name, data)
        if done is not None:
            yield done
    last = grouper.flush()
    if last is not None:
        yield last


class _Grouper:
    """Joins consecutive members of one key; a key that comes back later is an error."""

    def __init__(self, url: str, on_error: OnError, skips: SkipLog) -> None:
        self.url, self.on_error, self.skips = url, on_error, skips
        self.current: Sample | None = None
        self.seen: set[str] = set()
        self.bad_key: str | None = None  # members of a rejected fragment are dropped together

    def add(self, name: str, data: bytes) -> Sample | None:
        key, ext = split_name(name)
        if self.current is not None and key == self.current["__key__"]:
            self._add_member(key, ext, data)
            return None
        if key == self.bad_key:
            return None
        done = self.flush()
        if key in self.seen:
            self.bad_key = key
            handle(DataError("split-key", "key appears again after other keys (duplicated, or "
                             "its members are not next to each other)", source=self.url,
                             key=key), self.on_error, self.skips)
            return done
        self.seen.add(key)
        self.current = {"__key__": key, "__url__": self.url, ext: data}
        return done

    def _add_member(self, key: str, ext: str, data: bytes) -> None:
        assert self.current is not None
        if ext in self.current:
            self.current = None
            self.bad_key = key
            handle(DataError("duplicate-member", f"member {key}.{ext} appears twice",
                             source=self.url, key=key), self.on_error, self.skips)
            return
        self.current[ext] = data

    def flush(self) -> Sample | None:
        done, self.current = self.current, None
        return done
