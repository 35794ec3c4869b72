"""Reading tar shards safely, as a stream of samples.

Headers are parsed here, one 512-byte block at a time (tarfile's stream mode would take a
damaged header or a cut file for a clean end and lose the rest of a shard silently). A shard
must end with the end-of-archive block; a `.tar.gz` is decompressed to its end, so its CRC is
checked. Members are grouped into samples by key (the name up to the first dot of its base
name), as webdataset and DALI do: `img.0001.jpg` and `img.0002.jpg` are one sample `img` with
two extensions, passed on as such (`dotted_key` names it when a loader misses its `jpg`).
Member names are only ever used as keys, never as paths: links, devices and names that climb
out (`../`, `/abs`) are refused, folder entries (GNU tar's `train/`, `./`) are passed over,
and a member that declares more than `max_member_bytes` ends the shard before anything is
allocated. A `.gz` member (`key.txt.gz`) is decompressed and loses the suffix, as webdataset's
decoder does, to at most `max_member_bytes`: a compression bomb is refused, never allocated.
"""

from __future__ import annotations

import gzip
import posixpath
import tarfile
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, NamedTuple

from shardflow.errors import DataError, OnError, SkipLog, handle

Sample = dict[str, object]
BLOCK = 512
DEFAULT_MAX_MEMBER_BYTES = 256 * 1024 * 1024
MAX_EXTENDED_HEADER = 1024 * 1024
HOLD_BACK = 16  # samples held before passing on, to catch a key whose members come apart
_EXTENDED = {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
             tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE}


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


@dataclass
class _Member:
    name: str
    type: bytes
    size: int
    offset: int  # of the header


class _Blocks:
    """Exact reads from a stream, counting the offset; a short read is a truncated shard."""

    def __init__(self, stream: BinaryIO, url: str) -> None:
        self.stream, self.url, self.offset = stream, url, 0

    def read(self, n: int, what: str) -> bytes:
        parts, need = [], n
        while need:
            chunk = self.stream.read(min(need, 1 << 20))
            if not chunk:
                raise DataError("truncated", f"the shard ends inside {what} (at byte "
                                f"{self.offset + n - need})", source=self.url)
            parts.append(chunk)
            need -= len(chunk)
        self.offset += n
        return b"".join(parts)

    def read_upto(self, n: int) -> bytes:
        """Up to n bytes, fewer only at the end of the stream (reads may come back short)."""
        parts, need = [], n
        while need and (chunk := self.stream.read(need)):
            parts.append(chunk)
            need -= len(chunk)
        self.offset += n - need
        return b"".join(parts)

    def skip(self, n: int, what: str) -> None:
        while n:  # bounded memory: a declared size is only trusted one MiB at a time
            n -= len(self.read(min(n, 1 << 20), what))


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _headers(blocks: _Blocks) -> Iterator[_Member]:
    """Each member's header (extended GNU/PAX headers applied), up to the end-of-archive block."""
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        at = blocks.offset
        block = blocks.read_upto(BLOCK)
        if not block and at == 0:
            raise DataError("empty-shard", "the file is empty (0 bytes)", source=blocks.url)
        if not block:
            raise DataError("truncated", f"the shard ends at byte {at} without an end-of-"
                            "archive block (cut short?)", source=blocks.url)
        if len(block) < BLOCK:
            raise DataError("truncated", f"the shard ends inside a header at byte {at}",
                            source=blocks.url)
        if block == bytes(BLOCK):
            return
        info = _parse_header(block, at, blocks.url)
        if info.type in _EXTENDED:
            long_name, pax = _extended(blocks, info, at, long_name, pax)
            continue
        name = pax.pop("path", None) or long_name or info.name
        size = int(pax.pop("size", info.size))
        long_name, pax = None, {}
        yield _Member(name, info.type, size, at)


def _parse_header(block: bytes, at: int, url: str) -> tarfile.TarInfo:
    try:
        return tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError as exc:
        if at == 0:
            raise DataError("not-a-tar", f"not a tar archive ({exc}); an HTML error page saved "
                            "as .tar looks like this", source=url) from None
        raise DataError("bad-header", f"damaged tar header at byte {at} ({exc})",
                        source=url) from None


def _extended(blocks: _Blocks, info: tarfile.TarInfo, at: int, long_name: str | None,
              pax: dict[str, str]) -> tuple[str | None, dict[str, str]]:
    if info.size > MAX_EXTENDED_HEADER:
        raise DataError("bad-header", f"extended header at byte {at} declares {info.size} "
                        "bytes", source=blocks.url)
    data = blocks.read(_padded(info.size), "an extended header")[: info.size]
    if info.type == tarfile.GNUTYPE_LONGNAME:
        return data.rstrip(b"\0").decode("utf-8", "surrogateescape"), pax
    if info.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE):
        return long_name, {**pax, **_pax_records(data)}
    return long_name, pax  # long link names and global headers: nothing we use


def _pax_records(data: bytes) -> dict[str, str]:
    out = {}
    for line in data.decode("utf-8", "surrogateescape").split("\n"):
        _length, _, record = line.partition(" ")
        key, eq, value = record.partition("=")
        if eq and key in ("path", "size"):
            out[key] = value
    return out


def _refusal(m: _Member, url: str, limits: TarLimits) -> DataError | None:
    """Why a member is not used (None: it is fine). Members are never written anywhere."""
    key = split_name(m.name)[0]
    if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE):
        return DataError("not-a-regular-file", f"member {m.name!r} is a link, device or FIFO;"
                         " shards hold regular files only", source=url, key=key)
    if m.name.startswith("/") or ".." in m.name.split("/") or posixpath.isabs(m.name):
        return DataError("unsafe-member-name", f"member name {m.name!r} is absolute or climbs "
                         "out with '..'", source=url, key=key)
    if not split_name(m.name)[1] or not key or key.endswith("/"):
        return DataError("no-extension", f"member {m.name!r} has no key.extension form",
                         source=url, key=key)
    return None


def iter_members(stream: BinaryIO, url: str, limits: TarLimits
                 ) -> Iterator[tuple[str, bytes | DataError]]:
    """(name, bytes) per member in archive order, or (name, DataError) for a refused one.
    Damage to the shard itself (truncation, a bad header, an oversize member) raises."""
    for m in iter_located(stream, url, limits):
        yield m.name, m.data


class Located(NamedTuple):
    """A member and where its stored bytes lie: what a DALI index lists."""

    name: str  # `key.txt` for a stored `key.txt.gz`, whose data is gunzipped
    stored: str  # the name in the tar
    offset: int  # of the stored bytes (of the tar inside a gzipped shard)
    size: int
    data: bytes | DataError


def iter_located(stream: BinaryIO, url: str, limits: TarLimits) -> Iterator[Located]:
    """iter_members with where each member's stored bytes lie in the tar."""
    blocks = _Blocks(_maybe_gunzip(stream), url)
    for m in _headers(blocks):
        if m.type == tarfile.DIRTYPE:
            # GNU tar's `train/` and `./` entries: not samples, not skips (webdataset passes
            # them over too). Like tarfile, no data is read after a folder's header.
            continue
        if m.size > limits.max_member_bytes:
            raise DataError("member-too-large", f"member {m.name!r} declares {m.size} bytes, "
                            f"more than max_member_bytes={limits.max_member_bytes}",
                            source=url, key=split_name(m.name)[0])
        at = blocks.offset
        refusal = _refusal(m, url, limits)
        if refusal is not None:
            blocks.skip(_padded(m.size), f"member {m.name!r}")
            yield Located(m.name, m.name, at, m.size, refusal)
            continue
        data = blocks.read(_padded(m.size), f"member {m.name!r}")[: m.size]
        name, content = _gunzipped(m.name, data, url, limits) if _compressed(m.name) \
            else (m.name, data)
        yield Located(name, m.name, at, m.size, content)
    _drain(blocks)


def _compressed(name: str) -> bool:
    """`key.txt.gz`: a gzip-compressed member (a bare `key.gz` has no extension left)."""
    return split_name(name)[1].endswith(".gz")


def _gunzipped(name: str, data: bytes, url: str, limits: TarLimits
               ) -> tuple[str, bytes | DataError]:
    """(`key.txt`, its content) for `key.txt.gz`, or a refusal of that sample: corrupt, or
    more than max_member_bytes once expanded (checked as it expands, so a bomb costs at
    most the limit)."""
    plain, key = name[: -len(".gz")], split_name(name)[0]
    try:
        return plain, _gunzip(data, limits.max_member_bytes)
    except zlib.error as exc:
        return plain, DataError("bad-gzip", f"member {name!r} is not valid gzip ({exc})",
                                source=url, key=key)
    except _TooLarge:
        return plain, DataError("member-too-large", f"member {name!r} expands to more than "
                                f"max_member_bytes={limits.max_member_bytes} bytes (a "
                                "compression bomb?)", source=url, key=key)


class _TooLarge(Exception):
    pass


def _gunzip(data: bytes, limit: int) -> bytes:
    """The content of a gzip stream (several concatenated members too, as gzip writes them),
    never producing more than `limit` bytes."""
    out: list[bytes] = []
    size, rest = 0, data
    while True:
        z = zlib.decompressobj(wbits=31)  # 31: gzip header and CRC, checked
        chunk = z.decompress(rest, limit + 1 - size)
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        if not z.eof:
            raise zlib.error("the stream is cut short")
        out.append(chunk)
        rest = z.unused_data
        if not rest.strip(b"\0"):  # the end, or zero padding after it (gzip accepts both)
            return b"".join(out)


def _drain(blocks: _Blocks) -> None:
    """Read to the end, so that a gzip stream's CRC is checked."""
    try:
        while blocks.stream.read(1 << 20):
            pass
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError("truncated", f"compressed shard is corrupt or cut short ({exc})",
                        source=blocks.url) from None


def _maybe_gunzip(stream: BinaryIO) -> BinaryIO:
    head = stream.read(2)
    rest = _Prefixed(head, stream)
    if head == b"\x1f\x8b":
        return _GzipChecked(gzip.GzipFile(fileobj=rest, mode="rb"))  # type: ignore[call-overload,return-value]
    return rest  # type: ignore[return-value]


class _Prefixed:
    """A stream with some already-read bytes put back in front."""

    def __init__(self, head: bytes, stream: BinaryIO) -> None:
        self.head, self.stream = head, stream

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.stream.read(n)
        if n < 0:
            out, self.head = self.head + self.stream.read(), b""
        else:
            out, self.head = self.head[:n], self.head[n:]
        return out


class _GzipChecked:
    """gzip errors (bad CRC, cut stream) surface as DataError-friendly OSErrors on read."""

    def __init__(self, f: gzip.GzipFile) -> None:
        self.f = f

    def read(self, n: int = -1) -> bytes:
        try:
            return self.f.read(n)
        except (EOFError, zlib.error) as exc:
            raise OSError(f"gzip stream is corrupt or cut short: {exc}") from None


def iter_samples(stream: BinaryIO, url: str, *, limits: TarLimits | None = None,
                 on_error: OnError = "raise", skips: SkipLog | None = None,
                 located: Callable[[Located], None] | None = None) -> Iterator[Sample]:
    """Samples (`__key__`, `__url__`, ext -> bytes) of one shard, in archive order;
    `located` is shown each member and where it lies (what an index must say of it)."""
    limits, skips = limits or TarLimits(), skips if skips is not None else SkipLog()
    grouper = _Grouper(url, on_error, skips)
    try:
        for m in iter_located(stream, url, limits):
            if located is not None:
                located(m)
            yield from grouper.add(m.name, m.data)
    except OSError as exc:
        yield from grouper.fail(DataError("truncated", str(exc), source=url))
    except DataError as err:
        yield from grouper.fail(err)
    yield from grouper.finish()


def iter_regrouped(stream: BinaryIO, url: str, *, limits: TarLimits | None = None,
                   on_error: OnError = "raise", skips: SkipLog | None = None
                   ) -> Iterator[Sample]:
    """iter_samples for a shard whose keys' members may lie apart: a plain `tar -cf` of a
    folder stores files in directory order, so `a.jpg` and `a.cls` can be far apart. Every
    member is held until the shard ends, then each key's sample is passed on, in the order
    keys first appeared: memory bounded by the shard (make_shards reads it whole anyway). A
    member met twice is a second copy of its key: the first copy is kept, the rest of that
    key's members are passed over, and the copy is reported (split-key, as iter_samples
    reports it). A bad member drops its key. A shard that breaks passes on what it held but
    the key the break cut into, then raises, as iter_samples does."""
    limits, skips = limits or TarLimits(), skips if skips is not None else SkipLog()
    samples: dict[str, Sample] = {}
    bad: set[str] = set()  # dropped, or copied: their later members are passed over
    members = iter_members(stream, url, limits)
    while True:
        try:
            name, data = next(members)
        except StopIteration:
            break
        except (OSError, DataError) as exc:
            err = exc if isinstance(exc, DataError) else DataError("truncated", str(exc),
                                                                   source=url)
            samples.pop(err.key, None)
            yield from samples.values()
            raise err from None
        key, ext = split_name(name)
        if key in bad:
            continue
        sample = samples.setdefault(key, {"__key__": key, "__url__": url})
        if isinstance(data, DataError):
            bad.add(key)
            del samples[key]
            handle(data, on_error, skips)
        elif ext in sample:
            bad.add(key)
            handle(DataError("split-key", f"member {key}.{ext} appears again (a duplicate; "
                             "the first copy is kept)", source=url, key=key), on_error, skips)
        else:
            sample[ext] = data
    yield from samples.values()


def dotted_key(sample: Sample, wanted: tuple[str, ...]) -> DataError | None:
    """Why a sample has none of the `wanted` members (`jpg`, `png`...) when it has members
    whose extension ends with one after a dotted prefix (`0001.jpg`): its writer put dots in
    the keys (`img.0001.jpg`, `img.0002.jpg`), and webdataset's convention ends a key at the
    first dot of the base name, so those files became one sample `img`. Counted as one sample
    per such member. None when a wanted member is there or no dotted variant of one is."""
    if any(ext in sample for ext in wanted):
        return None
    dotted = sorted(e for e in sample if not e.startswith("__") and "." in e
                    and e.rpartition(".")[2] in wanted)
    if not dotted:
        return None
    key, samples = str(sample["__key__"]), len(dotted)
    names = ", ".join(repr(f"{key}.{e}") for e in dotted[:2])
    missing = " or .".join(sorted({e.rpartition(".")[2] for e in dotted}))
    return DataError("dotted-key", f"{samples} samples share this key: it has no .{missing} "
                     f"member, but member names such as {names} have dots before the "
                     "extension, and webdataset's convention ends the key at the first dot of "
                     "the file name; rename the files so that the first dot starts the "
                     "extension (make_shards.py makes such keys from the original files)",
                     source=str(sample["__url__"]), key=key, samples=samples)


class _Grouper:
    """Joins consecutive members of a key into a sample, holding the last few samples back so
    that a key whose members come apart is dropped whole rather than passed on in pieces."""

    def __init__(self, url: str, on_error: OnError, skips: SkipLog) -> None:
        self.url, self.on_error, self.skips = url, on_error, skips
        self.current: Sample | None = None
        self.held: deque[Sample] = deque()
        self.passed: set[str] = set()  # keys already passed on
        self.bad: set[str] = set()  # keys reported: their later members are dropped silently

    def add(self, name: str, data: bytes | DataError) -> Iterator[Sample]:
        key, ext = split_name(name)
        if key in self.bad:
            return
        if isinstance(data, DataError):
            self._reject(key, data)
            return
        if self.current is not None and key == self.current["__key__"]:
            self._add_member(key, ext, data)
            return
        yield from self._close_current()
        if self._seen(key, ext):
            return
        self.current = {"__key__": key, "__url__": self.url, ext: data}

    def _seen(self, key: str, ext: str) -> bool:
        """A key met again: a duplicate (its first copy had this member: keep that copy) or a
        sample whose members are apart (the first part is incomplete: drop it too)."""
        held = next((s for s in self.held if s["__key__"] == key), None)
        if held is None and key not in self.passed:
            return False
        detail = "key appears again after other keys"
        if held is not None and ext in held:
            detail += " (a duplicate; the first copy is kept)"
        elif held is not None:
            self.held.remove(held)
            detail += " (its members are apart; all of it is dropped)"
        else:
            detail += f" more than {HOLD_BACK} samples later; its first part was passed on"
        detail += ("; `shardflow convert shards` puts each key's members back together (a plain "
                   "`tar -cf` of a folder stores them in directory order)")
        self._reject(key, DataError("split-key", detail, source=self.url, key=key))
        return True

    def _add_member(self, key: str, ext: str, data: bytes) -> None:
        assert self.current is not None
        if ext in self.current:
            self._reject(key, DataError("duplicate-member", f"member {key}.{ext} appears twice",
                                        source=self.url, key=key))
        else:
            self.current[ext] = data

    def _reject(self, key: str, err: DataError) -> None:
        if self.current is not None and self.current["__key__"] == key:
            self.current = None
        self.bad.add(key)
        handle(err, self.on_error, self.skips)

    def _close_current(self) -> Iterator[Sample]:
        if self.current is not None:
            self.held.append(self.current)
            self.current = None
        while len(self.held) > HOLD_BACK:
            yield self._pass(self.held.popleft())

    def _pass(self, sample: Sample) -> Sample:
        self.passed.add(str(sample["__key__"]))
        return sample

    def fail(self, err: DataError) -> Iterator[Sample]:
        """The shard broke: pass on the complete samples before the break, drop the sample
        the break cut into, and raise: the caller applies its policy to the lost shard rest."""
        if self.current is not None and self.current["__key__"] == err.key:
            self.current = None
        yield from self.finish()
        raise err

    def finish(self) -> Iterator[Sample]:
        yield from self._close_current()
        while self.held:
            yield self._pass(self.held.popleft())
