"""Writing tar shards: deterministic bytes, size/count limits, atomic files, DALI index.

Each shard is written under a hidden temporary name, flushed, fsynced and renamed, together
with its DALI index (`train-000000.idx` beside `train-000000.tar`), so a crash, a kill or a
full disk never leaves a partial file under a final name. Tar headers carry fixed fields
(mtime 0, uid/gid 0, mode 0644, no user names) so equal input gives byte-identical shards.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from shardflow.atomic import fsync_dir, write_atomic
from shardflow.errors import DataError
from shardflow.shards import daliindex
from shardflow.shards.manifest import ShardInfo

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


@dataclass(frozen=True)
class FileRef:
    """A member's bytes as a local file holds them: what a conversion worker checked and
    kept unchanged, sent as a path, which the one process writing shards reads again. With
    several workers, reading a file from the page cache costs that process less than taking
    the bytes out of a pipe (and the worker less than putting them in). `stamp` is the
    file's (size, mtime_ns, ctime_ns, device) when the worker read it, the same before and
    after its read; a file whose stamp differs when read again was changed, and its bytes
    are not what was checked. (Any write sets ctime, which no tool can set back; the inode is
    left out: some network and FUSE mounts renumber unchanged files.)"""

    path: str
    stamp: tuple[int, int, int, int]

    @property
    def size(self) -> int:
        return self.stamp[0]

    def read(self) -> bytes:
        """The file's bytes, or DataError "file-changed" when it is not the file that was
        checked (gone, or its stamp moved before or during this read). Other errors
        reading it (EIO, too many open files) are raised as they are: not bad input."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise DataError("file-changed", "the file went away after it was checked; "
                            "convert again", source=self.path) from None
        try:  # os calls, not a file object: a tenth of this process's time per image
            before = stamp_of(fd)
            data = _read_all(fd, self.size + 1)  # one more: a file that grew
            after = stamp_of(fd)
        finally:
            os.close(fd)
        if before != self.stamp or after != self.stamp or len(data) != self.size:
            raise DataError("file-changed", "the file changed after it was checked; convert "
                            "again", source=self.path)
        return data


def _read_all(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes, reading on after a short read (network and FUSE mounts give
    them); one read for a local file."""
    pieces, got = [], 0
    while got < limit and (piece := os.read(fd, limit - got)):
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def stamp_of(fd: int) -> tuple[int, int, int, int]:
    """FileRef's stamp of an open file."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev


Part = bytes | FileRef


@dataclass(frozen=True)
class Packed:
    """A sample as the bytes its members take in a shard (headers, data, padding), built
    where the sample was checked: a conversion's workers pack in parallel what the one
    process writing shards would otherwise pack in turn. Wherever it lies in a shard, a
    sample's tar bytes are the same, so packed or not, the shards are byte-identical.
    `parts` are those bytes in order, a member's data possibly a FileRef (`resolved()`
    reads it)."""

    key: str
    parts: tuple[Part, ...]
    size: int  # the bytes of all parts
    members: tuple[tuple[str, int, int, str], ...]  # ext, data offset in the parts, size, name
    fields: Mapping[str, object]  # "__" fields and small members (a label): what is tallied

    def get(self, name: str, default: object = None) -> object:
        return self.fields.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self.fields or any(m[0] == name for m in self.members)

    def __getitem__(self, name: str) -> object:
        return self.fields[name]

    def resolved(self) -> Packed:
        """This sample with every FileRef read (DataError "file-changed" for a file that is
        no longer what was checked): all of it, before any of it is written."""
        if not any(isinstance(part, FileRef) for part in self.parts):
            return self
        parts = tuple(p.read() if isinstance(p, FileRef) else p for p in self.parts)
        return Packed(self.key, parts, self.size, self.members, self.fields)


SMALL_MEMBER = 256  # members up to this size stay readable in Packed.fields (labels)


def pack(sample: Sample | Packed) -> Packed:
    """`sample`'s members as GNU tar bytes, in the writer's fixed order and fields."""
    if isinstance(sample, Packed):
        return sample
    key = str(sample["__key__"])
    parts: list[Part] = []
    members = []
    at = 0
    for ext, data in _members(sample):
        name = f"{key}.{ext}"
        size = data.size if isinstance(data, FileRef) else len(data)
        header = _tarinfo(name, size).tobuf(tarfile.GNU_FORMAT, tarfile.ENCODING,
                                            "surrogateescape")
        pad = -size % BLOCK
        parts += [header, data, bytes(pad)] if pad else [header, data]
        members.append((ext, at + len(header), size, name))
        at += len(header) + size + pad
    fields = {k: v for k, v in sample.items()
              if k.startswith("__") or (isinstance(v, bytes) and len(v) <= SMALL_MEMBER)}
    return Packed(key, _joined(parts), at, tuple(members), fields)


def _joined(parts: list[Part]) -> tuple[Part, ...]:
    """Runs of bytes joined into one: fewer writes, and one part for a sample of bytes."""
    out: list[Part] = []
    run: list[bytes] = []
    for part in parts:
        if isinstance(part, bytes):
            run.append(part)
        else:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(part)
    if run:
        out.append(b"".join(run))
    return tuple(out)


def member_bytes(name: str, size: int) -> int:
    """Bytes one member takes in a GNU tar: header, long-name blocks, padded data."""
    blocks = 1 + -(-size // BLOCK)
    if len(name.encode()) >= tarfile.LENGTH_NAME:
        blocks += 1 + -(-(len(name.encode()) + 1) // BLOCK)
    return blocks * BLOCK


def sample_bytes(sample: Sample | Packed) -> int:
    if isinstance(sample, Packed):
        return sample.size
    key = str(sample["__key__"])
    return sum(member_bytes(f"{key}.{ext}", v.size if isinstance(v, FileRef) else len(v))
               for ext, v in _members(sample))


def _members(sample: Sample) -> list[tuple[str, Part]]:
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
        self._entries: list[list[tuple[str, int, int, str]]] = []

    def shard_name(self, index: int | None = None) -> str:
        return f"{self.prefix}-{self.index if index is None else index:06d}.tar"

    @property
    def open_samples(self) -> int:
        return len(self._entries)

    @property
    def open_bytes(self) -> int:
        return self._hashing.pos if self._hashing is not None else 0

    def fits(self, sample: Sample | Packed) -> bool:
        """Whether `sample` still fits in the open shard (an empty shard takes anything)."""
        if not self._entries:
            return True
        if len(self._entries) >= self.max_count:
            return False
        assert self._hashing is not None
        return self._hashing.pos + sample_bytes(sample) + END_OF_ARCHIVE <= self.max_size

    def write(self, sample: Sample | Packed) -> None:
        """Append `sample` (a Packed with file parts: resolve it first)."""
        packed = pack(sample)
        if self._hashing is None:
            self._open()
        assert self._hashing is not None
        if packed.size + END_OF_ARCHIVE > self.max_size:
            log.warning("sample %r (%d bytes) is larger than max_size=%d; it gets a shard of "
                        "its own", packed.key, packed.size, self.max_size)
        at = self._hashing.pos
        for part in packed.resolved().parts:
            self._hashing.write(part)  # type: ignore[arg-type]
        self._entries.append([(ext, at + offset, size, name)
                              for ext, offset, size, name in packed.members])

    def _open(self) -> None:
        self._raw = open(self._tmp(self.shard_name()), "wb")  # noqa: SIM115 - owned, closed in finish
        self._hashing = _HashingFile(self._raw)

    def _tmp(self, name: str) -> Path:
        return self.out / f".{name}.tmp"

    def finish(self) -> ShardInfo | None:
        """Close the open shard, write its index and give both their final names."""
        if self._hashing is None:
            return None
        assert self._raw is not None
        # The end of the archive as tarfile writes it: two zero blocks, then zeros to a
        # whole record.
        end = 2 * BLOCK
        self._hashing.write(bytes(end + -(self._hashing.pos + end) % END_OF_ARCHIVE))
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
        self._raw = self._hashing = None
        self._entries = []
        self.index += 1
        return info

    def abort(self) -> None:
        """Drop the open shard: close and delete its temporary file."""
        if self._raw is not None:
            self._raw.close()
            self._tmp(self.shard_name()).unlink(missing_ok=True)
        self._raw = self._hashing = None
        self._entries = []


def _write_atomic_text(path: Path, text: str) -> None:
    write_atomic(path, text.encode())
