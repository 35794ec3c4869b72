"""Local indexed shards read straight through their `.idx` offsets: a few numpy and bytes calls
a read, over a memory map of each shard, with no pipeline to build and no thread of its own.

    the rank's shards, in plan order -> each shard's table from its .idx (cached): per sample
      its key and where its members are (the first of `exts`, `.cls`, `extras`)
    -> that stream cut into windows of `shuffle_buffer` samples, each window's samples in
       an order drawn from (seed, epoch, rank, window)
    -> the plan's length -> reads of `batch_size` samples, each read's data member gathered
       from the maps in one join (EncodedBatch.flat)

Why it exists: on pre-tokenized text (text/pretokenized.py) the documents are small and need
no decoding, and DALI's reader cost more than everything else the loader does: building each
epoch's reader pipeline, a call per read and the checkpoints came to half the stage thread's
time. Here a read of 256 documents costs a slice of arrays and one `b"".join`.

The shuffle is a window shuffle, not a buffer: each window of `shuffle_buffer` consecutive
samples of the stream (shards in the epoch's order) comes out in a random order, and windows
come in turn. A sample moves at most a window from its place, as with a buffer of that size
(a buffer keeps a few samples far longer; a window never does). `shuffle_buffer` 0 or 1 reads
in order.

The position is the number of samples emitted this epoch: resuming rebuilds the windows
(tables are cached; a window's order is drawn again from its seed) and skips that many, so
it continues exactly. The rest of an epoch resumed on another number of ranks is streamed
(readers.encoded), as for DALI's reader. Every member the tables point at lies within the
shard: readers.check_local_shards checks each shard against its index when the loader is
built, and a shard found shorter later (cut or replaced) is a `truncated` DataError naming it.
(Cut while it is mapped, a shard can also end the process with SIGBUS, as with any mmap.)
"""

from __future__ import annotations

import mmap
import operator
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardflow.errors import DataError
from shardflow.loading.batch import EncodedBatch
from shardflow.loading.readplan import EpochPlan
from shardflow.shards.daliindex import parse_index
from shardflow.shards.tarread import split_name
from shardflow.urls import redact

# Samples whose tables stay cached (a table costs about 100 bytes a sample): the shards of a
# few epochs of a rank on the usual datasets, parsed once per process, not once per epoch.
TABLE_SAMPLES = 2_000_000


@dataclass(frozen=True)
class _Table:
    """One shard's samples as the reader needs them: key, and (offset, size) of each column
    (the data member, .cls, each extra), size -1 where the sample has no such member."""

    keys: np.ndarray  # object: str
    spans: np.ndarray  # int64 (samples, columns, 2)

    def __len__(self) -> int:
        return len(self.keys)


class _Tables:
    """Shard tables by the index file's identity, least recently used dropped past
    TABLE_SAMPLES samples in all. Shared by the loaders of a process, hence the lock."""

    def __init__(self, budget: int) -> None:
        self.budget, self.held = budget, 0
        self._lock = threading.Lock()
        self._tables: OrderedDict[tuple[Any, ...], _Table] = OrderedDict()

    def get(self, idx: str, columns: tuple[tuple[str, ...], ...]) -> _Table:
        st = os.stat(idx)
        key = (idx, st.st_mtime_ns, st.st_size, columns)
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
                return table
        table = _parse(idx, columns)
        with self._lock:
            if key not in self._tables:
                self._tables[key], self.held = table, self.held + len(table)
            while self.held > self.budget and len(self._tables) > 1:
                _, old = self._tables.popitem(last=False)
                self.held -= len(old)
        return table


_TABLES = _Tables(TABLE_SAMPLES)


def _parse(idx: str, columns: tuple[tuple[str, ...], ...]) -> _Table:
    """The table of one index: for each column (extensions in preference order), the first
    member of each sample that has one of them."""
    with open(idx) as f:
        try:
            samples = parse_index(f.read())
        except (ValueError, UnicodeDecodeError) as exc:
            raise DataError("bad-index", f"{idx}: {exc}") from None
    spans = np.full((len(samples), len(columns), 2), -1, np.int64)
    keys = np.empty(len(samples), object)
    rank = [{ext: r for r, ext in enumerate(exts)} for exts in columns]
    for i, members in enumerate(samples):
        keys[i] = split_name(members[0][3])[0] if members else ""
        for c, order in enumerate(rank):
            found = [(order[ext], off, size) for ext, off, size, _ in members if ext in order]
            if found:
                _, off, size = min(found)
                spans[i, c] = off, size
    return _Table(keys, spans)


class _Maps:
    """The rank's shards mapped read-only (_MAPPED), each looked up once a pass and let go
    once the stream is past it (a map holds an open file: a pass over thousands of shards
    must not hold them all)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._maps: list[mmap.mmap | None] = [None] * len(urls)
        self._low = 0  # shards before this one are done: windows only move forward

    def of(self, shards: np.ndarray) -> list[mmap.mmap]:
        """The maps of `shards` (plan positions), one per sample."""
        wanted = np.unique(shards).tolist()
        for shard in range(self._low, wanted[0]):
            self._maps[shard] = None
        self._low = max(self._low, wanted[0])
        for shard in wanted:
            if self._maps[shard] is None:
                self._maps[shard] = _MAPPED.get(self.urls[shard])
        if len(shards) == 1:
            return [self._maps[int(shards[0])]]  # type: ignore[list-item]
        return list(operator.itemgetter(*shards.tolist())(self._maps))


class _Mapped:
    """Shards mapped read-only, kept across passes, at most `limit`, least recently used
    dropped (not closed: a map goes when its last user lets go of it). Mapped afresh every
    epoch (opened, mapped, its pages faulted in, closed), the shards took about a tenth of
    this reader's time on short documents. A shard rewritten in place is mapped again (its
    inode, size or mtime changed)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._maps: OrderedDict[tuple[Any, ...], mmap.mmap] = OrderedDict()

    def get(self, path: str) -> mmap.mmap:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
            with self._lock:
                found = self._maps.get(key)
                if found is not None:
                    self._maps.move_to_end(key)
                    return found
            # An empty file cannot be mapped; an empty shard has no members to read.
            found = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if st.st_size else \
                mmap.mmap(-1, 1)
        with self._lock:
            self._maps[key] = found
            while len(self._maps) > self.limit:
                self._maps.popitem(last=False)
        return found


# Shards kept mapped between passes, per process (an open file each).
MAPPED_SHARDS = 256
_MAPPED = _Mapped(MAPPED_SHARDS)


def batches(plan: EpochPlan, state: dict[str, Any] | None, exts: tuple[str, ...],
            extras: tuple[str, ...] = (), views: bool = True) -> Iterator[EncodedBatch]:
    """This rank's encoded batches for the epoch from `state` ({"emitted": n}; None: from the
    start): each sample's first member among `exts` (empty when it has none), its `.cls`,
    and the members named by `extras` (None where it has none). `views=False`: the data
    column as `flat` only, `data` left empty until EncodedBatch.unpack (a consumer that takes
    the column whole: a view a sample was a twentieth of the stored-ids loader's time)."""
    if plan.length is None:
        raise ValueError("the index reader needs sample counts (manifest.json or .idx files)")
    if plan.rest:
        raise ValueError("the rest of an epoch resumed elsewhere is read by the streaming "
                         "reader")
    columns = (exts, ("cls",), *((e,) for e in extras))
    tables = (_TABLES.get(s.index_url, columns) for s in plan.shards)  # as the stream reaches them
    emitted = int(state["emitted"]) if state else 0
    maps = _Maps([s.url for s in plan.shards])
    urls = [redact(s.url) for s in plan.shards]
    for read in _reads(_windows(plan, tables), plan.batch_size, plan.length, emitted):
        emitted += len(read)
        yield _encoded(read, maps, urls, extras, {"emitted": emitted}, views)


@dataclass
class _Rows:
    """Samples of the stream, as parallel arrays: shard (plan position), key, spans."""

    shards: np.ndarray
    keys: np.ndarray
    spans: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, cut: Any) -> _Rows:
        return _Rows(self.shards[cut], self.keys[cut], self.spans[cut])

    @staticmethod
    def joined(parts: list[_Rows]) -> _Rows:
        if len(parts) == 1:
            return parts[0]
        return _Rows(*(np.concatenate([getattr(p, f) for p in parts])
                       for f in ("shards", "keys", "spans")))


def _windows(plan: EpochPlan, tables: Iterator[_Table]) -> Iterator[_Rows]:
    """The rank's stream in windows of shuffle_buffer samples, each in its drawn order (the
    shards whole, in plan order, without shuffling). Memory: a window and a shard's table."""
    size = plan.shuffle_buffer if plan.shuffle_buffer > 1 else 0
    held: list[_Rows] = []
    count, window = 0, 0
    for pos, table in enumerate(tables):
        rows = _Rows(np.full(len(table), pos, np.int32), table.keys, table.spans)
        if not size:
            yield rows
            continue
        while len(rows):
            take = min(size - count, len(rows))
            held.append(rows[:take])
            rows, count = rows[take:], count + take
            if count == size:
                yield _drawn(_Rows.joined(held), plan, window)
                held, count, window = [], 0, window + 1
    if held:
        yield _drawn(_Rows.joined(held), plan, window)


def _drawn(rows: _Rows, plan: EpochPlan, window: int) -> _Rows:
    rng = np.random.default_rng([plan.seed % 2**64, plan.epoch, plan.rank, window, 0x77696E64])
    return rows[rng.permutation(len(rows))]


def _reads(windows: Iterator[_Rows], batch_size: int, length: int, skip: int
           ) -> Iterator[_Rows]:
    """The stream cut into reads of batch_size samples, the first `skip` samples passed over
    and nothing past `length` (a rank's even share of the epoch)."""
    held: list[_Rows] = []
    count, seen = 0, 0
    for rows in windows:
        if seen >= length:
            break
        rows = rows[: length - seen]
        seen += len(rows)
        if skip:
            passed = min(skip, len(rows))
            rows, skip = rows[passed:], skip - passed
        while len(rows):
            take = min(batch_size - count, len(rows))
            held.append(rows[:take])
            rows, count = rows[take:], count + take
            if count == batch_size:
                yield _Rows.joined(held)
                held, count = [], 0
    if held:
        yield _Rows.joined(held)


def _encoded(read: _Rows, maps: _Maps, urls: list[str], extras: tuple[str, ...],
             state: dict[str, Any], views: bool) -> EncodedBatch:
    shards = read.shards.tolist()
    mapped = maps.of(read.shards)
    flat = _gather(mapped, read.spans[:, 0])
    if len(flat[0]) != int(flat[1].sum()):
        _refuse_short(read, mapped, urls)
    batch = EncodedBatch(read.keys.tolist(), [urls[s] for s in shards], [],
                         _members(mapped, read.spans[:, 1], least=1), state, flat=flat)
    if views:
        batch.unpack()
    for c, ext in enumerate(extras, 2):
        batch.extras[ext] = _members(mapped, read.spans[:, c])
    return batch


def _gather(mapped: list[mmap.mmap], spans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A column's members (empty where missing) as one uint8 buffer and their sizes: one
    join of map slices (a numpy gather by index arrays was 3x slower on short documents)."""
    offsets, sizes = spans[:, 0].tolist(), np.maximum(spans[:, 1], 0)
    joined = b"".join([m[o: o + n] for m, o, n in zip(mapped, offsets, sizes.tolist(),
                                                       strict=True)])
    return np.frombuffer(joined, np.uint8), sizes


def _refuse_short(read: _Rows, mapped: list[mmap.mmap], urls: list[str]) -> None:
    """A member its index points past the end of its shard: the shard was cut or replaced
    after the loader checked it (an mmap slice past the end is just short)."""
    for m, shard, key, (off, size) in zip(mapped, read.shards.tolist(), read.keys.tolist(),
                                          read.spans[:, 0].tolist(), strict=True):
        if size > 0 and off + size > len(m):
            raise DataError("truncated", f"the shard has {len(m)} bytes but its index points "
                            f"up to byte {off + size}: it was cut or replaced after the "
                            "loader was built", source=urls[shard], key=key)


def _members(mapped: list[mmap.mmap], spans: np.ndarray, least: int = 0
             ) -> list[bytes | None]:
    """A column's members as bytes, None where a sample has none or one under `least` bytes
    (labels: an empty .cls is none, as DALI's reader gives it). A column most shards lack,
    such as .cls of text, costs one check."""
    if (spans[:, 1] < least).all():
        return [None] * len(mapped)
    return [m[o: o + n] if n >= least else None
            for m, (o, n) in zip(mapped, spans.tolist(), strict=True)]

