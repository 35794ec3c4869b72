"""Indexes for shards made elsewhere (``shardflow index` SRC [--out DIR]`), without rewriting
a shard.

    SRC's shards      -> each read once: its DALI index (where every member's bytes lie),
                         samples, bytes and sha256, the labels of its .cls members
                      -> NAME.idx beside each shard, or in DIR (written whole, then renamed)
                      -> manifest.json last, beside them or in DIR: counts, checksums,
                         modality, label statistics

So DALI's reader and every loader's rank split and exact resume work on shards that
webdataset's writers, GNU tar or another tool made. SRC is a local folder (the indexes go
beside the shards), or, with `--out DIR`, anything the loaders read: a read-only folder, a
glob, a brace pattern, an `https://` or `s3://` URL; the loaders then take `index=DIR`
(shards/indexdir.py). The index lists exactly what the readers read as samples; a shard they
would not read as it is (gzipped, a key's members apart or one twice, a refused member), or
not alike through an index (a gzipped `key.txt.gz` member, whitespace in a member name), gets
no index and is named with what to do: mostly, `shardflow convert shards` rewrites it. Under
`--on-error skip` such a shard stays in the manifest, counted as the streaming reader reads
it and marked `unindexed` with the reason: the loaders stream it, so no shard is hidden. A folder's
shards are those the loaders list (.tar, .tar.gz, .tgz); a file that only its case hides from
them (`A.TAR`) is named too. A run that stops goes on where it stopped: each indexed shard is
journalled (JOURNAL, in the output folder) with its size and version (mtime, or a remote
store's ETag), and a rerun reads only the shards not yet done or changed since.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from shardflow.atomic import write_atomic
from shardflow.errors import DataError, OnError, SkipLog, handle
from shardflow.samples.checks import check_label, modality_of
from shardflow.shards import daliindex, indexdir
from shardflow.shards.listing import list_shards, regular_file, unlisted
from shardflow.shards.manifest import MANIFEST, LabelStats, Manifest, ShardInfo
from shardflow.shards.tarread import Located, TarLimits, iter_located, iter_samples, split_name
from shardflow.shards.verify import HashingReader
from shardflow.urls import redact

JOURNAL = ".shardflow-index.jsonl"
GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class Indexed:
    """One shard's index and what the manifest says of it."""

    info: ShardInfo
    index: str  # the .idx text
    exts: tuple[str, ...]
    labels: LabelStats | None

    def journal_line(self, version: tuple[int, str]) -> str:
        return json.dumps({**self.info.to_json(), "version": version[1],
                           "exts": list(self.exts),
                           "labels": self.labels.to_json() if self.labels else None}) + "\n"


def index_shard(url: str, limits: TarLimits,
                storage_options: Mapping[str, Any] | None = None) -> Indexed:
    """Read one shard (a path or any fsspec URL) and index it; DataError for a shard the
    readers would not read as indexed (the reason says what `shardflow convert shards` would do)."""
    shown = redact(url)
    samples: list[list[daliindex.Entry]] = []
    keys: set[str] = set()
    exts: set[str] = set()
    labels: list[int] = []
    current: str | None = None
    try:
        regular_file(url, samples=None)  # a FIFO named .tar would block the open forever
    except DataError as err:
        raise err.located(source=shown) from None
    with fsspec.open(url, "rb", **(storage_options or {})) as raw:
        if raw.read(2) == GZIP_MAGIC:
            raise DataError("compressed-shard", "a gzipped tar: DALI's reader reads members at "
                            "their offsets in a plain tar; `shardflow convert shards` rewrites it",
                            source=shown)
        raw.seek(0)
        reader = HashingReader(raw)
        for m in iter_located(reader, shown, limits):  # type: ignore[arg-type]
            key, ext = split_name(m.stored)
            data = _checked(m, shown)
            if key != current:
                if key in keys:
                    raise DataError("split-key", "the key's members lie apart (after other "
                                    "keys); `shardflow convert shards` puts them back together",
                                    source=shown, key=key)
                keys.add(key)
                samples.append([])
                current = key
            elif any(e[0] == ext for e in samples[-1]):
                raise _duplicate(key, ext, shown)
            samples[-1].append((ext, m.offset, m.size, m.stored))
            exts.add(ext)
            if ext == "cls":
                labels += _label(data)
        reader.drain()
    info = ShardInfo(indexdir.shard_name(url), len(samples), reader.count, reader.sha.hexdigest())
    return Indexed(info, daliindex.format_index(samples), tuple(sorted(exts)),
                   LabelStats.of(labels) if labels else None)


def _checked(m: Located, shown: str) -> bytes:
    """The member's bytes; DataError for a member the readers refuse, or one an index cannot
    point them at as the streaming reader reads it."""
    key, ext = split_name(m.stored)
    if isinstance(m.data, DataError):
        raise DataError(m.data.reason, f"{m.data.detail}; the readers refuse it, so the "
                        "shard is not indexed as it is (`shardflow convert shards` leaves it out)",
                        source=shown, key=key)
    if m.name != m.stored:  # `key.txt.gz`, which the streaming reader gunzips
        raise DataError("compressed-member", f"member {m.stored!r} is gzipped: the streaming "
                        f"reader reads it unpacked as .{split_name(m.name)[1]}, while DALI's "
                        f"reader and the index reader would take its packed bytes as .{ext}; "
                        "`shardflow convert shards` rewrites it unpacked", source=shown, key=key)
    if daliindex.has_whitespace(m.stored):
        # A plain `tar -cf` of a camera's folder gives `IMG 0001.jpg`. The converter makes
        # keys safe (sources.make_keys) but keeps extensions as they are.
        fix = ("rename the file and pack it again (`shardflow convert shards` keeps extensions as "
               "they are)" if daliindex.has_whitespace(ext) else "`shardflow convert shards` "
               "rewrites it with its keys made safe ('IMG 0001' -> 'IMG_0001')")
        raise DataError("whitespace-name", f"member name {m.stored!r} holds whitespace, which "
                        f"a DALI index cannot hold (its fields are split on it); {fix}",
                        source=shown, key=key)
    return m.data


def _duplicate(key: str, ext: str, shown: str) -> DataError:
    """A key with one member twice in a row (a tar extended with `tar -rf`)."""
    return DataError("duplicate-member", f"member {key}.{ext} appears twice: the streaming "
                     "reader refuses the key, DALI's reader would take one copy; `shardflow "
                     "convert shards --on-error skip` rewrites it with the first copy (and "
                     "names the key in its report)", source=shown, key=key)


def _label(data: bytes) -> list[int]:
    """The label of a .cls member, for the statistics; none for a bad one (the loaders name
    it when they read it)."""
    try:
        return [check_label(data, None)]
    except DataError:
        return []


def index_source(src: str | Path, out: str | Path | None = None, *,
                 limits: TarLimits | None = None, on_error: OnError = "raise",
                 progress: Any = None, storage_options: Mapping[str, Any] | None = None
                 ) -> Manifest:
    """Index every shard of `src` (see the module's docstring), writing the indexes and
    manifest beside the shards (`out` None: `src` must be a local folder) or in the local
    folder `out`; the manifest."""
    limits = limits or TarLimits()
    src = str(src)
    folder = _output_folder(src, out)
    if (folder / MANIFEST).exists():
        where = "these shards have" if out is None else f"{folder} holds"
        raise ValueError(f"{folder / MANIFEST} exists: {where} a manifest already (verify "
                         "them with verify_shards; remove it to index them again)")
    urls = _shards(src, storage_options)
    done = _journal(folder / JOURNAL)
    skips = SkipLog()
    for err in unlisted(src, urls):
        handle(err, on_error, skips)
    indexed: list[Indexed] = []
    with open(folder / JOURNAL, "a") as journal:
        for url in urls:
            idx = folder / indexdir.index_path(indexdir.shard_name(url), None)
            version = _version(url, storage_options)
            entry = _reusable(done.get(indexdir.shard_name(url)), version, idx)
            if entry is None:
                try:
                    entry = _indexed(url, version, limits, storage_options)
                except DataError as err:
                    if on_error == "raise":
                        raise
                    entry = _unindexed(url, err, limits, storage_options, skips)
                    if entry is None:
                        continue
                    idx.unlink(missing_ok=True)  # a stale one would send DALI's reader there
                else:
                    write_atomic(idx, entry.index.encode())
                    journal.write(entry.journal_line(version))
                    journal.flush()
                    os.fsync(journal.fileno())
            indexed.append(entry)
            if progress is not None:
                progress(indexdir.shard_name(url))
    manifest = _manifest(indexed, skips, src if out is not None else folder.name)
    manifest.save(folder / MANIFEST)
    (folder / JOURNAL).unlink()
    return manifest


def index_folder(src: Path, **kwargs: Any) -> Manifest:
    """index_source with the indexes beside the shards of the local folder `src`."""
    return index_source(src, None, **kwargs)


def _output_folder(src: str, out: str | Path | None) -> Path:
    if out is not None:
        if "://" in str(out):
            raise ValueError(f"--out {redact(str(out))}: the index folder is local (DALI's "
                             "reader opens its .idx files as files)")
        Path(out).mkdir(parents=True, exist_ok=True)
        return Path(out)
    if "://" in src or not Path(src).is_dir():
        raise ValueError(f"{redact(src)}: not a local folder; to index remote shards, a glob or "
                         "a pattern, give --out DIR (the loaders then take index=DIR)")
    if not os.access(src, os.W_OK):
        raise ValueError(f"{src}: cannot write beside these shards (read-only); give --out "
                         "DIR (the loaders then take index=DIR)")
    return Path(src)


def _shards(src: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    """The shards to index: what the loaders list (a folder's .tar, .tar.gz and .tgz files, so
    that a gzipped one is named, not left out of a manifest that then hides it from them),
    else what the pattern or URL lists; two with one name would share one .idx."""
    urls = list_shards(src, storage_options)
    if not urls:
        odd = [Path(err.source).name for err in unlisted(src, [])][:5]
        raise ValueError(f"{redact(src)}: no shards to index (.tar, .tar.gz or .tgz files"
                         + (f"; {', '.join(odd)}: rename to lower case)" if odd else ")"))
    names = [indexdir.shard_name(u) for u in urls]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{redact(src)}: shards share a name ({', '.join(twice[:5])}); an "
                         "index folder holds one NAME.idx per name: index them apart")
    return urls


def _version(url: str, storage_options: Mapping[str, Any] | None) -> tuple[int, str]:
    """(size, version) of a shard: a changed shard is indexed again on a rerun. A local file's
    version is its mtime; a remote store's, its ETag or last-modified time where it says."""
    if "://" not in url:
        st = os.stat(url)
        return st.st_size, str(st.st_mtime_ns)
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    info = fs.info(path)
    stamp = next((info[k] for k in ("ETag", "etag", "LastModified", "last_modified", "mtime")
                  if info.get(k) is not None), "")
    return int(info.get("size") or 0), str(stamp)


def _indexed(url: str, version: tuple[int, str], limits: TarLimits,
             storage_options: Mapping[str, Any] | None) -> Indexed:
    entry = index_shard(url, limits, storage_options)
    if version[0] and entry.info.bytes != version[0]:
        raise DataError("shard-changed", f"the store said {version[0]} bytes, {entry.info.bytes}"
                        " were read: the shard changed while it was indexed", source=redact(url))
    return entry


def _unindexed(url: str, why: DataError, limits: TarLimits,
               storage_options: Mapping[str, Any] | None, skips: SkipLog) -> Indexed | None:
    """A shard left without an index stays in the manifest, marked with `why`, counted as the
    streaming reader reads it, which the loaders then read it with: an index never hides a
    shard. Its bad samples are skips, as the loaders' would be; None (a skip of the whole
    shard) when it cannot be opened at all."""
    shown = redact(url)
    found = SkipLog(announce=False)
    exts: set[str] = set()
    labels: list[int] = []
    count = 0
    try:
        regular_file(url, samples=None)
        with fsspec.open(url, "rb", **(storage_options or {})) as raw:
            reader = HashingReader(raw)
            for sample in iter_samples(reader, shown, limits=limits,  # type: ignore[arg-type]
                                       on_error="skip", skips=found):
                count += 1
                exts.update(k for k in sample if not k.startswith("__"))
                if isinstance(sample.get("cls"), bytes):
                    labels += _label(sample["cls"])  # type: ignore[arg-type]
            reader.drain()
    except (DataError, OSError) as err:
        skips.add(err.located(source=shown) if isinstance(err, DataError) else
                  DataError("unreadable-shard", str(err), source=shown))
        return None
    skips.extend(found.entries)
    info = ShardInfo(indexdir.shard_name(url), count, reader.count, reader.sha.hexdigest(),
                     unindexed=why.reason)
    return Indexed(info, "", tuple(sorted(exts)), LabelStats.of(labels) if labels else None)


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


def _reusable(doc: dict[str, Any] | None, version: tuple[int, str], idx: Path
              ) -> Indexed | None:
    """A journalled shard, when it has not changed since and its index is still there."""
    if doc is None or (doc["bytes"], doc.get("version")) != version or not idx.is_file():
        return None
    return Indexed(ShardInfo.from_json(doc), idx.read_text(), tuple(doc["exts"]),
                   LabelStats.from_json(doc["labels"]))


def _manifest(indexed: list[Indexed], skips: SkipLog, src: str) -> Manifest:
    labels = [v for e in indexed if e.labels for v in e.labels.values()]
    return Manifest(shards=[e.info for e in indexed],
                    modality=modality_of({x for e in indexed for x in e.exts}),
                    skipped=skips.entries, args={"kind": "index", "src": redact(src)},
                    labels=LabelStats.of(labels) if labels else None)
