"""Indexes for shards made elsewhere (`make_shards index SRC`), without rewriting a shard.

    SRC/*.tar  -> each read once: its DALI index (where every member's bytes lie), samples,
                  bytes and sha256, the labels of its .cls members
               -> SRC/NAME.idx beside each shard (written whole, then renamed)
               -> SRC/manifest.json last: counts, checksums, modality, label statistics

So DALI's reader and every loader's rank split and exact resume work on shards that
webdataset's writers, GNU tar or another tool made. The index lists exactly what the readers
read as samples; a shard they would not read as it is (gzipped, a key's members apart, a
refused member) gets no index and is named: `make_shards shards` rewrites such shards. A run
that stops goes on where it stopped: each indexed shard is journalled (SRC/JOURNAL) with its
size and mtime, and a rerun reads only the shards not yet done or changed since.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.atomic import write_atomic
from pipeline.errors import DataError, OnError, SkipLog, handle
from pipeline.samples.checks import check_label, modality_of
from pipeline.shards import daliindex
from pipeline.shards.manifest import MANIFEST, LabelStats, Manifest, ShardInfo
from pipeline.shards.tarread import TarLimits, iter_located, split_name
from pipeline.shards.verify import HashingReader

JOURNAL = ".shardflow-index.jsonl"
GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class Indexed:
    """One shard's index and what the manifest says of it."""

    info: ShardInfo
    index: str  # the .idx text
    exts: tuple[str, ...]
    labels: LabelStats | None

    def journal_line(self, st: os.stat_result) -> str:
        return json.dumps({**self.info.to_json(), "mtime_ns": st.st_mtime_ns,
                           "exts": list(self.exts),
                           "labels": self.labels.to_json() if self.labels else None}) + "\n"


def index_shard(path: Path, limits: TarLimits) -> Indexed:
    """Read one shard and index it; DataError for a shard the readers would not read as
    indexed (the reason says what `make_shards shards` would do about it)."""
    url = str(path)
    samples: list[list[daliindex.Entry]] = []
    keys: set[str] = set()
    exts: set[str] = set()
    labels: list[int] = []
    current: str | None = None
    with open(path, "rb") as raw:
        if raw.read(2) == GZIP_MAGIC:
            raise DataError("compressed-shard", "a gzipped tar: DALI's reader reads members at "
                            "their offsets in a plain tar; make_shards shards rewrites it",
                            source=url)
        raw.seek(0)
        reader = HashingReader(raw)
        for m in iter_located(reader, url, limits):  # type: ignore[arg-type]
            key, ext = split_name(m.stored)
            if isinstance(m.data, DataError):
                raise DataError(m.data.reason, f"{m.data.detail}; the readers refuse it, so the "
                                "shard is not indexed as it is (make_shards shards leaves it "
                                "out)", source=url, key=key)
            if key != current:
                if key in keys:
                    raise DataError("split-key", "the key's members lie apart (after other "
                                    "keys); make_shards shards puts them back together",
                                    source=url, key=key)
                keys.add(key)
                samples.append([])
                current = key
            samples[-1].append((ext, m.offset, m.size, m.stored))
            exts.add(ext)
            if ext == "cls":
                labels += _label(m.data)
        reader.drain()
    info = ShardInfo(path.name, len(samples), reader.count, reader.sha.hexdigest())
    return Indexed(info, daliindex.format_index(samples), tuple(sorted(exts)),
                   LabelStats.of(labels) if labels else None)


def _label(data: bytes) -> list[int]:
    """The label of a .cls member, for the statistics; none for a bad one (the loaders name
    it when they read it)."""
    try:
        return [check_label(data, None)]
    except DataError:
        return []


def index_folder(src: Path, *, limits: TarLimits | None = None, on_error: OnError = "raise",
                 progress: Any = None) -> Manifest:
    """Index every `*.tar` of `src` (see the module's docstring); the manifest."""
    limits = limits or TarLimits()
    if (src / MANIFEST).exists():
        raise ValueError(f"{src / MANIFEST} exists: these shards have a manifest already "
                         "(verify them with verify_shards; remove it to index them again)")
    paths = sorted(p for p in src.glob("*.tar") if p.is_file())
    if not paths:
        raise ValueError(f"{src}: no .tar shards to index")
    done = _journal(src / JOURNAL)
    skips = SkipLog()
    indexed: list[Indexed] = []
    with open(src / JOURNAL, "a") as journal:
        for path in paths:
            st = path.stat()
            entry = _reusable(done.get(path.name), st, path)
            if entry is None:
                try:
                    entry = index_shard(path, limits)
                except DataError as err:
                    handle(err, on_error, skips)  # under "skip": no index, listed in skipped
                    continue
                write_atomic(path.with_suffix(".idx"), entry.index.encode())
                journal.write(entry.journal_line(st))
                journal.flush()
                os.fsync(journal.fileno())
            indexed.append(entry)
            if progress is not None:
                progress(path.name)
    manifest = _manifest(indexed, skips, src)
    manifest.save(src / MANIFEST)
    (src / JOURNAL).unlink()
    return manifest


def _journal(path: Path) -> dict[str, dict[str, Any]]:
    """The shards a stopped run indexed, by name (a torn last line is passed over)."""
    if not path.exists():
        return {}
    found: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        found[str(doc["name"])] = doc
    return found


def _reusable(doc: dict[str, Any] | None, st: os.stat_result, path: Path) -> Indexed | None:
    """A journalled shard, when it has not changed since and its index is still there."""
    if doc is None or (doc["bytes"], doc["mtime_ns"]) != (st.st_size, st.st_mtime_ns):
        return None
    idx = path.with_suffix(".idx")
    if not idx.is_file():
        return None
    return Indexed(ShardInfo.from_json(doc), idx.read_text(), tuple(doc["exts"]),
                   LabelStats.from_json(doc["labels"]))


def _manifest(indexed: list[Indexed], skips: SkipLog, src: Path) -> Manifest:
    labels = [v for e in indexed if e.labels for v in e.labels.values()]
    return Manifest(shards=[e.info for e in indexed],
                    modality=modality_of({x for e in indexed for x in e.exts}),
                    skipped=skips.entries, args={"kind": "index", "src": src.name},
                    labels=LabelStats.of(labels) if labels else None)
