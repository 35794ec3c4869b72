"""Writing tar shards: deterministic bytes, size/count limits, atomic files, DALI index.

Each shard is written under a hidden temporary name, flushed, fsynced and renamed, together
with its DALI index (`train-000000.idx` beside `train-000000.tar`), so a crash, a kill or a
full disk never leaves a partial file under a final name. Tar headers carry fixed fields
(mtime 0, uid/gid 0, mode 0644, no user names) so equal input gives byte-identical shards.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tarfile
from pathlib import Path
from typing import BinaryIO

from pipeline.atomic import fsync_dir, write_atomic
from pipeline.shards import daliindex
from pipeline.shards.manifest import ShardInfo

log = logging.getLogger(__name__)

BLOCK = tarfile.BLOCKSIZE
# tarfile closes an archive with two zero blocks padded to a 20-block record.
END_OF_ARCHIVE = tarfile.RECORDSIZE
Sample = dict[str, object]  # "__key__": str, then extension -> bytes


class _HashingFile:
    """A write-only file wrapper that hashes and counts what passes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.sha, self.pos = raw, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.pos += len(data)
        return self.raw.write(data)

    def tell(self) -> int:
        return self.pos


def member_bytes(name: str, size: int) -> int:
    """Bytes one member takes in a GNU tar: header, long-name blocks, padded data."""
    blocks = 1 + -(-size // BLOCK)
    if len(name.encode()) >= tarfile.LENGTH_NAME:
        blocks += 1 + -(-(len(name.encode()) + 1) // BLOCK)
    return blocks * BLOCK


def sample_bytes(sample: Sample) -> int:
    key = str(sample["__key__"])
    return sum(member_bytes(f"{key}.{ext}", len(v)) for ext, v in _members(sample))


def _members(sample: Sample) -> list[tuple[str, bytes]]:
    # A fixed member order (sorted extensions) keeps shards byte-identical across runs.
    return sorted((k, v) for k, v in sample.items() if not k.startswith("__"))  # type: ignore[misc]


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info



class ShardWriter:
    """Writes samples into `out/{prefix}-{index:06d}.tar` shards under count and size limits.

    The caller decides when a shard ends (`fits` then `finish`), so that it can record which
    inputs each finished shard holds. `close()` finishes the open shard; `abort()` removes it.
    """

    def __init__(self, out: Path, prefix: str, *, max_count: int, max_size: int,
                 start_index: int = 0) -> None:
        self.out, self.prefix = Path(out), prefix
        self.max_count, self.max_size = max_count, max_size
        self.index = start_index
        self._raw: BinaryIO | None = None
        self._hashing: _HashingFile | None = None
        self._tar: tarfile.TarFile | None = None
        self._entries: list[list[tuple[str, int, int, str]]] = []

    def shard_name(self, index: int | None = None) -> str:
        return f"{self.prefix}-{self.index if index is None else index:06d}.tar"

    @property
    def open_samples(self) -> int:
        return len(self._entries)

    @property
    def open_bytes(self) -> int:
        return self._hashing.pos if self._hashing is not None else 0

    def fits(self, sample: Sample) -> bool:
        """Whether `sample` still fits in the open shard (an empty shard takes anything)."""
        if not self._entries:
            return True
        if len(self._entries) >= self.max_count:
            return False
        assert self._hashing is not None
        return self._hashing.pos + sample_bytes(sample) + END_OF_ARCHIVE <= self.max_size

    def write(self, sample: Sample) -> None:
        if self._tar is None:
            self._open()
        size = sample_bytes(sample)
        if size + END_OF_ARCHIVE > self.max_size:
            log.warning("sample %r (%d bytes) is larger than max_size=%d; it gets a shard of "
                        "its own", sample["__key__"], size, self.max_size)
        assert self._tar is not None
        entry = []
        for ext, data in _members(sample):
            info = _tarinfo(f"{sample['__key__']}.{ext}", len(data))
            header = info.tobuf(self._tar.format, self._tar.encoding, self._tar.errors)
            data_offset = self._tar.offset + len(header)
            self._tar.addfile(info, io.BytesIO(data))
            entry.append((ext, data_offset, info.size, info.name))
        self._entries.append(entry)

    def _open(self) -> None:
        self._raw = open(self._tmp(self.shard_name()), "wb")  # noqa: SIM115 - owned, closed in finish
        self._hashing = _HashingFile(self._raw)
        self._tar = tarfile.open(fileobj=self._hashing, mode="w",  # type: ignore[call-overload]
                                 format=tarfile.GNU_FORMAT)

    def _tmp(self, name: str) -> Path:
        return self.out / f".{name}.tmp"

    def finish(self) -> ShardInfo | None:
        """Close the open shard, write its index and give both their final names."""
        if self._tar is None:
            return None
        assert self._raw is not None and self._hashing is not None
        self._tar.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        name = self.shard_name()
        idx_name = name[: -len(".tar")] + ".idx"
        _write_atomic_text(self.out / idx_name, daliindex.format_index(self._entries))
        os.replace(self._tmp(name), self.out / name)
        fsync_dir(self.out)
        info = ShardInfo(name, len(self._entries), self._hashing.pos,
                         self._hashing.sha.hexdigest())
        self._tar = self._raw = self._hashing = None
        self._entries = []
        self.index += 1
        return info

    def abort(self) -> None:
        """Drop the open shard: close and delete its temporary file."""
        if self._raw is not None:
            self._raw.close()
            self._tmp(self.shard_name()).unlink(missing_ok=True)
        self._tar = self._raw = self._hashing = None
        self._entries = []


def _write_atomic_text(path: Path, text: str) -> None:
    write_atomic(path, text.encode())
