"""Verifying shards: checksums, tar structure, keys, DALI index and every sample's content.

Each shard is streamed once: its bytes are hashed as the tar reader consumes them, samples
are checked as they go by, and each member's size and CRC are kept so that the DALI index can
then be checked entry by entry against the bytes at the offsets it names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from shardflow import executor
from shardflow.errors import DataError, SkipLog
from shardflow.samples.checks import IMAGE_MEMBERS, TEXT_EXTS, CheckLimits, check_sample
from shardflow.shards import daliindex, indexdir
from shardflow.shards.listing import list_shards, regular_file, unlisted
from shardflow.shards.manifest import MANIFEST, Manifest, ShardInfo, TokenForm, load_manifest
from shardflow.shards.tarread import Located, TarLimits, dotted_key, iter_samples
from shardflow.storage import timed
from shardflow.text import pretokenized
from shardflow.urls import redact

REQUIRED = {"image": (IMAGE_MEMBERS,), "text": (TEXT_EXTS,), "pointcloud": (("npy",),)}


class HashingReader:
    """A read-only wrapper that hashes and counts every byte read through it."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.sha, self.count = raw, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.sha.update(data)
        self.count += len(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


@dataclass
class ShardReport:
    """What verification found in one shard."""

    url: str
    samples: int = 0
    bytes: int = 0
    sha256: str = ""
    expected: ShardInfo | None = None
    problems: list[dict[str, str]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class VerifyOptions:
    limits: CheckLimits = field(default_factory=CheckLimits)
    tar_limits: TarLimits = field(default_factory=TarLimits)
    modality: str | None = None
    num_classes: int | None = None
    tokens: TokenForm | None = None  # the manifest's: documents stored as token ids
    # fsspec's options for the shard URLs (endpoint, credentials): never shown
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    index: str | None = None  # the folder holding the .idx files, when not beside the shards


def shard_urls(source: str, storage_options: Mapping[str, Any] | None = None,
               index: str | None = None
               ) -> tuple[list[tuple[str, ShardInfo | None]], Manifest | None]:
    """Each shard's URL with what the manifest says of it, and the manifest: from a folder/URL
    holding manifest.json, from an index folder's (`index`: shards/indexdir.py), or none."""
    if index is not None:
        found, manifest = indexdir.matched(source, index, storage_options)
        return list(found), manifest
    base = source.rstrip("/")
    fs, path = fsspec.core.url_to_fs(base, **(storage_options or {}))
    if fs.isdir(path) and fs.exists(f"{path}/{MANIFEST}"):
        manifest = load_manifest(f"{base}/{MANIFEST}", storage_options)
        return [(f"{base}/{s.name}", s) for s in manifest.shards], manifest
    return [(url, None) for url in list_shards(source, storage_options)], None


def verify_shard(url: str, expected: ShardInfo | None, opts: VerifyOptions) -> ShardReport:
    report = ShardReport(redact(url), expected=expected)
    skips = SkipLog(announce=False)
    members: dict[str, tuple[int, int]] = {}  # stored name -> (offset, size), as streamed
    packed: list[str] = []  # gzipped members (`key.txt.gz`), which no index can describe

    def located(m: Located) -> None:
        members[m.stored] = (m.offset, m.size)
        if m.name != m.stored:
            packed.append(m.stored)

    try:
        regular_file(url, samples=None)  # a FIFO named .tar would block the open forever
        with timed("reading shard", url, opts.storage_options), \
                fsspec.open(url, "rb", **opts.storage_options) as raw:  # timeout: not missing
            reader = HashingReader(raw)
            try:
                for sample in iter_samples(reader, report.url, limits=opts.tar_limits,  # type: ignore[arg-type]
                                           on_error="skip", skips=skips, located=located):
                    report.samples += 1
                    report.keys.append(str(sample["__key__"]))
                    _check(sample, opts, skips)
            except DataError as err:
                skips.add(err)
            reader.drain()
    except FileNotFoundError:
        skips.add(DataError("missing-shard", "the shard does not exist", source=report.url))
        report.problems = skips.entries
        return report
    except DataError as err:  # not a regular file
        skips.add(err.located(source=report.url))
        report.problems = skips.entries
        return report
    report.bytes, report.sha256 = reader.count, reader.sha.hexdigest()
    _compare(report, expected, skips)
    if expected is None or expected.unindexed is None:  # else the loaders stream it
        _check_index(url, members, packed, skips, opts)
    report.problems = skips.entries
    return report


def _check(sample: dict[str, object], opts: VerifyOptions, skips: SkipLog) -> None:
    try:
        check_sample(sample, opts.limits, opts.num_classes)
        _check_required(sample, opts)
        if opts.tokens is not None:  # whole ids, each below the tokenizer's vocabulary
            try:
                pretokenized.ids_of(sample[opts.tokens.member], opts.tokens)  # type: ignore[arg-type]
            except DataError as err:
                raise err.located(source=str(sample["__url__"]),
                                  key=str(sample["__key__"])) from None
    except DataError as err:
        skips.add(err)


def _check_required(sample: dict[str, object], opts: VerifyOptions) -> None:
    groups = list(REQUIRED.get(opts.modality or "", ()))
    if opts.tokens is not None:
        groups = [(opts.tokens.member,)]
    if opts.num_classes is not None:
        groups.append(("cls",))
    for group in groups:
        if not any(ext in sample for ext in group):
            dotted = dotted_key(sample, tuple(group))
            if dotted is not None:
                raise dotted
            named = dict.fromkeys(ext.lower() for ext in group)  # .JPG is .jpg's case
            raise DataError("missing-field", f"no .{' or .'.join(named)} member",
                            source=str(sample["__url__"]), key=str(sample["__key__"]))


def _compare(report: ShardReport, expected: ShardInfo | None, skips: SkipLog) -> None:
    if expected is None:
        return
    for what, got, want in (("sha256", report.sha256, expected.sha256),
                            ("bytes", report.bytes, expected.bytes),
                            ("samples", report.samples, expected.samples)):
        if got != want:
            skips.add(DataError(f"{what}-mismatch", f"{what} is {got}, the manifest says "
                                f"{want}: the shard changed after it was written",
                                source=report.url))


def _check_index(url: str, members: dict[str, tuple[int, int]], packed: list[str],
                 skips: SkipLog, opts: VerifyOptions) -> None:
    """The shard's .idx (beside it, or in the index folder) must point at exactly the bytes we
    read for each member: at the offset and size the streaming pass found it (which needs no
    range request, so a server without them is verified as the loaders read it)."""
    if url.endswith((".tar.gz", ".tgz")):
        return  # DALI cannot read a compressed shard, index or not: the streaming reader does
    storage_options = opts.storage_options
    idx_url = indexdir.index_path(url, opts.index)
    fs, path = fsspec.core.url_to_fs(idx_url, **storage_options)
    try:
        regular_file(idx_url)  # a FIFO where the .idx belongs would block the read
    except DataError as err:
        skips.add(DataError("bad-index", err.detail, source=redact(idx_url)))
        return
    if not fs.exists(path):
        where = "beside the shard" if opts.index is None else f"at {redact(idx_url)}"
        why = "; DALI would scan the whole tar at start-up" if not packed else (
            f"; its gzipped members ({', '.join(packed[:3])}) keep `shardflow index` from "
            "making one: `shardflow convert shards` rewrites it unpacked")
        skips.add(DataError("missing-index", f"no DALI index (.idx) {where}{why}",
                            source=redact(url)))
        return
    try:
        entries = [e for s in daliindex.parse_index(fs.cat_file(path).decode()) for e in s]
    except (ValueError, UnicodeDecodeError) as exc:
        skips.add(DataError("bad-index", str(exc), source=redact(idx_url)))
        return
    for _ext, offset, size, name in entries:
        if members.get(name) != (offset, size):
            skips.add(DataError("bad-index", f"index entry for {name!r} does not point at "
                                "that member's bytes", source=redact(idx_url)))
            return
    if len(entries) != len(members):
        skips.add(DataError("bad-index", f"index lists {len(entries)} members, the tar holds "
                            f"{len(members)}", source=redact(idx_url)))


def _verify_one(item: tuple[str, ShardInfo | None], opts: VerifyOptions) -> ShardReport:
    with timed("checking the index of", item[0], opts.storage_options):
        return verify_shard(item[0], item[1], opts)


def verify(source: str, *, workers: int = 1, limits: CheckLimits | None = None,
           timeout_s: float | None = None,
           progress: Callable[[int, int], None] | None = None,
           storage_options: Mapping[str, Any] | None = None, index: str | None = None
           ) -> tuple[list[ShardReport], Manifest | None]:
    """Verify every shard of `source`; reports come back in shard order. With workers > 1 a
    shard whose check takes over `timeout_s` is reported hung (executor.WorkerError).
    `progress(samples, shards)` is called as each shard's report arrives: (its samples, the
    total number of shards). `storage_options`: fsspec's keyword arguments for its URLs.
    `index`: a folder with the shards' manifest and .idx files (shards/indexdir.py)."""
    items, manifest = shard_urls(source, storage_options, index)
    odd: list[DataError] = []  # files of the folder no loader reads, named as problems
    if index is None:
        odd = unlisted(source, [url for url, _ in items])
        if manifest is not None:
            odd += _not_in_manifest(source, items)
    if not items and not odd:
        raise FileNotFoundError(f"{redact(source)}: no shards found")
    opts = VerifyOptions(limits or CheckLimits(), TarLimits(),
                         manifest.modality if manifest else None,
                         len(manifest.classes) if manifest and manifest.classes else None,
                         manifest.tokens if manifest else None, dict(storage_options or {}),
                         index)
    reports = []
    for report in executor.ordered_map(_verify_one, items, opts, workers, chunk=1,
                                       timeout_s=timeout_s,
                                       describe=lambda item: redact(item[0])):
        reports.append(report)
        if progress is not None:
            progress(report.samples, len(items))
    _check_keys_across_shards(reports)
    for err in odd:  # what only its case hides from every loader (`A.TAR`)
        found = SkipLog(announce=False)
        found.add(err)
        reports.append(ShardReport(err.source, problems=found.entries))
    return reports, manifest


def _not_in_manifest(source: str, items: list[tuple[str, ShardInfo | None]]
                     ) -> list[DataError]:
    """Shards of a local folder that its manifest.json does not list: the loaders read a
    folder through its manifest, so they would never read them (a FIFO `index` passed over,
    a shard copied in after it ran)."""
    if "://" in source or not Path(source).is_dir():
        return []
    listed = {Path(url).name for url, _ in items}
    return [DataError("not-in-manifest", "manifest.json does not list it, so no loader reads "
                      "it: index or convert the folder again", source=url)
            for url in list_shards(source) if Path(url).name not in listed]


def _check_keys_across_shards(reports: list[ShardReport]) -> None:
    """A key in two shards means two samples a loader cannot tell apart (or one sample twice)."""
    first: dict[str, str] = {}
    for report in reports:
        for key in report.keys:
            if key in first:
                report.problems.append({
                    "source": report.url, "key": key, "reason": "duplicate-key",
                    "detail": f"key also in {first[key]}"})
            else:
                first[key] = report.url


def problem_counts(reports: list[ShardReport]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in reports:
        for p in r.problems:
            counts[p["reason"]] = counts.get(p["reason"], 0) + 1
    return dict(sorted(counts.items()))
