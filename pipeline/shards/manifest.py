"""`manifest.json`: what a shard folder holds, with checksums, counts, classes and skips.

Written last and atomically by make_shards, so its presence means the conversion finished.
With `--part i/n`, each part writes `manifest.part-III-of-NNN.json` and `merge_parts` combines
them into `manifest.json` once every part is done.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from shardflow.atomic import write_atomic
from shardflow.shards import segstats
from shardflow.storage import Store
from shardflow.urls import redact

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
TOOL = "shardflow.make_shards"
_PART = re.compile(r"^manifest\.part-(\d+)-of-(\d+)\.json$")


def tool_version() -> str:
    from shardflow import __version__

    return __version__


def part_manifest_name(index: int, count: int) -> str:
    return f"manifest.part-{index:03d}-of-{count:03d}.json"


@dataclass(frozen=True)
class ShardInfo:
    """One finished shard, as recorded in manifest.json."""

    name: str
    samples: int
    bytes: int
    sha256: str
    # Why `shardflow index` left it without a .idx (a reason: "compressed-shard", ...): the
    # loaders stream it, counted all the same. None: indexed, or written by the converter.
    unindexed: str | None = None

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"name": self.name, "samples": self.samples,
                                  "bytes": self.bytes, "sha256": self.sha256}
        if self.unindexed is not None:
            doc["unindexed"] = self.unindexed
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> ShardInfo:
        unindexed = doc.get("unindexed")
        return cls(str(doc["name"]), int(doc["samples"]), int(doc["bytes"]),  # type: ignore[call-overload]
                   str(doc["sha256"]), None if unindexed is None else str(unindexed))


@dataclass(frozen=True)
class LabelStats:
    """The labels of the samples written, as sorted disjoint ranges [first, last]: how many
    distinct, the smallest and the largest (what training without a class map sizes its
    classifier by), and which are absent; ranges keep it small and merge exactly."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, labels: Iterable[int]) -> LabelStats:
        ranges: list[list[int]] = []
        for label in sorted(set(labels)):
            if ranges and label == ranges[-1][1] + 1:
                ranges[-1][1] = label
            else:
                ranges.append([label, label])
        return cls(tuple((a, b) for a, b in ranges))

    def values(self) -> Iterator[int]:
        for first, last in self.ranges:
            yield from range(first, last + 1)

    def to_json(self) -> dict[str, object]:
        return {"distinct": sum(b - a + 1 for a, b in self.ranges), "min": self.ranges[0][0],
                "max": self.ranges[-1][1], "ranges": [list(r) for r in self.ranges]}

    @classmethod
    def from_json(cls, doc: object) -> LabelStats | None:
        """None for a manifest without label statistics (older ones, unlabelled data)."""
        if not isinstance(doc, dict) or not doc.get("ranges"):
            return None
        return cls(tuple((int(a), int(b)) for a, b in doc["ranges"]))


@dataclass(frozen=True)
class TokenForm:
    """How a pre-tokenized text set stores its documents (pipeline/text/pretokenized.py): the
    tokenizer that made the ids (as its `describe()` names it), and the member holding each
    document's ids, little-endian `dtype` ("uint16" when the vocabulary fits, else "uint32")."""

    tokenizer: str  # "bytes" or "hf"
    vocab_size: int
    sha256: str | None  # of the tokenizer.json; None for the built-in bytes
    member: str  # "tokens.u16" or "tokens.u32"
    dtype: str

    def to_json(self) -> dict[str, object]:
        return {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size,
                "sha256": self.sha256, "member": self.member, "dtype": self.dtype}

    @classmethod
    def from_json(cls, doc: object) -> TokenForm | None:
        """None for text stored as documents (and every other modality)."""
        if not isinstance(doc, dict):
            return None
        return cls(str(doc["tokenizer"]), int(doc["vocab_size"]),
                   None if doc.get("sha256") is None else str(doc["sha256"]),
                   str(doc["member"]), str(doc["dtype"]))


@dataclass
class Manifest:
    """The JSON document; `shards` in name order, `skipped` each with source and reason.
    `reencoded` counts the images repaired so that the loaders decode them, per reason, and
    what --max-side did to images (downsize.OUTCOMES: resized, re-encoded, kept for a mask);
    `offset_clouds` the point clouds stored relative to an offset; `labels` the label
    statistics (None: no labels, or a manifest written before they were recorded)."""

    shards: list[ShardInfo]
    modality: str
    classes: dict[str, int] | None = None
    skipped: list[dict[str, str]] = field(default_factory=list)
    ignored: list[dict[str, str]] = field(default_factory=list)
    args: dict[str, object] = field(default_factory=dict)
    tool_version: str = field(default_factory=tool_version)
    reencoded: dict[str, int] = field(default_factory=dict)
    offset_clouds: int = 0
    labels: LabelStats | None = None
    # The tabular kind's: {"schema": {...}, "rows": N, "blocks": N, "rows_per_block": N}
    tabular: dict[str, Any] | None = None
    tokens: TokenForm | None = None  # text stored as token ids (make_shards --tokenizer)
    # scenes labelled per point (make_shards pointcloud --layout scans|kitti): segstats.py
    segmentation: dict[str, Any] | None = None

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def to_json(self) -> dict[str, object]:
        extra: dict[str, object] = {"tabular": self.tabular} if self.tabular is not None else {}
        if self.tokens is not None:
            extra["tokens"] = self.tokens.to_json()
        if self.segmentation is not None:
            extra["segmentation"] = self.segmentation
        return {
            "format_version": FORMAT_VERSION, "tool": TOOL, "tool_version": self.tool_version,
            "modality": self.modality, "total_samples": self.total_samples,
            "shards": [s.to_json() for s in self.shards], "classes": self.classes,
            "skipped": self.skipped, "skipped_counts": _counts(self.skipped),
            "ignored": self.ignored, "args": self.args,
            "reencoded": dict(sorted(self.reencoded.items())),
            "offset_clouds": self.offset_clouds,
            "labels": self.labels.to_json() if self.labels else None, **extra,
        }

    @classmethod
    def from_json(cls, doc: dict[str, object], where: str = "manifest") -> Manifest:
        try:
            shards = [ShardInfo.from_json(s) for s in doc["shards"]]  # type: ignore[attr-defined]
            return cls(shards, str(doc["modality"]), doc.get("classes"),  # type: ignore[arg-type]
                       list(doc.get("skipped", [])), list(doc.get("ignored", [])),  # type: ignore[call-overload]
                       dict(doc.get("args", {})), str(doc.get("tool_version", "?")),  # type: ignore[call-overload]
                       # absent from manifests written before these were recorded
                       {str(k): int(v) for k, v in dict(doc.get("reencoded") or {}).items()},  # type: ignore[call-overload]
                       int(doc.get("offset_clouds") or 0),  # type: ignore[call-overload]
                       LabelStats.from_json(doc.get("labels")),
                       dict(doc["tabular"]) if doc.get("tabular") else None,  # type: ignore[call-overload]
                       TokenForm.from_json(doc.get("tokens")),
                       dict(doc["segmentation"]) if doc.get("segmentation") else None)  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not a shardflow manifest ({exc!r})") from None

    def encode(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1) + "\n").encode()

    def save(self, path: Path) -> None:
        write_atomic(path, self.encode())


def _counts(entries: list[dict[str, str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in entries:
        out[e["reason"]] = out.get(e["reason"], 0) + 1
    return dict(sorted(out.items()))


def load_manifest(url: str, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """Read `manifest.json` from a folder or URL (anything fsspec opens; `storage_options`:
    fsspec's keyword arguments for it)."""
    with fsspec.open(url, "rb", **(storage_options or {})) as f:
        return parse_manifest(f.read(), redact(url))


def parse_manifest(data: bytes, where: str) -> Manifest:
    """A manifest from its bytes; `where` names it in errors."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: manifest is not valid JSON ({exc})") from None
    return Manifest.from_json(doc, where)


def merge_parts(out: str | Path, storage_options: Mapping[str, Any] | None = None
                ) -> Manifest:
    """Combine every part manifest in `out` (a folder or an fsspec URL prefix) into
    `manifest.json`; all n parts must be there."""
    store = Store(out, storage_options)
    parts = {int(m.group(1)): (int(m.group(2)), name) for name in store.names("manifest.*.json")
             if (m := _PART.match(name))}
    if not parts:
        raise FileNotFoundError(f"{store}: no part manifests (manifest.part-*-of-*.json)")
    count = next(iter(parts.values()))[0]
    missing = sorted(set(range(count)) - set(parts))
    if missing or any(n != count for n, _ in parts.values()):
        raise ValueError(f"{store}: parts {missing} of {count} are missing or part counts "
                         "differ; finish every part before merging")
    manifests = [parse_manifest(store.read_bytes(parts[i][1]), store.where(parts[i][1]))
                 for i in range(count)]
    merged = _merge(manifests, store)
    store.write_bytes(MANIFEST, merged.encode())
    return merged


def _merge(manifests: list[Manifest], out: Store) -> Manifest:
    first = manifests[0]

    def job(m: Manifest) -> dict[str, object]:
        return {k: v for k, v in m.args.items() if k not in ("part", "on_error")}

    for i, m in enumerate(manifests[1:], 1):
        mine, base = job(m), job(first)
        differ = sorted(k for k in set(mine) | set(base) if mine.get(k) != base.get(k))
        if differ or m.modality != first.modality or m.classes != first.classes:
            raise ValueError(f"{out}: part {i} was converted with other arguments than part 0 "
                             f"(differ: {differ or 'modality/classes'}); parts must come from "
                             "one source with the same arguments")
    args = {k: v for k, v in first.args.items() if k != "part"}
    return Manifest(
        shards=sorted((s for m in manifests for s in m.shards), key=lambda s: s.name),
        modality=first.modality, classes=first.classes,
        skipped=[e for m in manifests for e in m.skipped],
        ignored=[e for m in manifests for e in m.ignored],
        args={**args, "merged_parts": len(manifests)},
        reencoded=_summed([m.reencoded for m in manifests]),
        offset_clouds=sum(m.offset_clouds for m in manifests),
        labels=_merged_labels(manifests),
        tabular=_merged_tabular(manifests),
        tokens=first.tokens,  # the same tokenizer in every part: its sha256 is in the args
        segmentation=segstats.merged([m.segmentation for m in manifests if m.segmentation])
        if first.segmentation else None,
    )


def _merged_tabular(manifests: list[Manifest]) -> dict[str, Any] | None:
    if manifests[0].tabular is None:
        return None
    return {**manifests[0].tabular,
            "rows": sum(int((m.tabular or {}).get("rows", 0)) for m in manifests),
            "blocks": sum(m.total_samples for m in manifests)}


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for reason, n in c.items():
            out[reason] = out.get(reason, 0) + n
    return dict(sorted(out.items()))


def _merged_labels(manifests: list[Manifest]) -> LabelStats | None:
    """The union of the parts' labels; unknown when a part holding samples has none
    recorded (written by an older version), since the union would then be too small."""
    if any(m.labels is None and m.total_samples for m in manifests):
        return None
    if all(m.labels is None for m in manifests):
        return None
    return LabelStats.of(v for m in manifests if m.labels for v in m.labels.values())
