"""What a shard set holds, counted from its raw members (images by their headers, nothing
decoded): classes, image sizes and aspects, text lengths and tokens, points per cloud.

Counted over every sample, or over `limit` of them drawn evenly from (seed) when the set is
larger (said in the result). Bad samples are counted by reason, not raised.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardflow.access.dataset import ShardDataset
from shardflow.access.decode import MAX_PIXELS
from shardflow.errors import DataError
from shardflow.samples import checks, headers
from shardflow.samples.checks import IMAGE_MEMBERS, POINTCLOUD_EXTS, TEXT_EXTS

BINS = 12  # at most; fewer where the data holds fewer distinct values


def gather(ds: ShardDataset, limit: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The statistics of `ds` (raw members), JSON-able."""
    indexes: Sequence[int] = range(len(ds))
    if limit is not None and len(ds) > limit:
        indexes = sorted(random.Random(seed).sample(range(len(ds)), limit))
    found: dict[str, list[float]] = {"width": [], "height": [], "aspect": [], "length": [],
                                     "tokens": [], "points": []}
    labels: Counter[int] = Counter()
    bad: Counter[str] = Counter()
    for i in indexes:
        sample = ds.raw(i)
        if sample is None:  # raw reads fail only on a cut shard (on_error="skip")
            bad["unreadable"] += 1
            continue
        try:
            _count(sample, ds, found, labels)
        except DataError as err:
            bad[err.reason] += 1
    return _summary(ds, len(indexes), found, labels, bad)


def _count(sample: dict[str, Any], ds: ShardDataset, found: dict[str, list[float]],
           labels: Counter[int]) -> None:
    """Add the sample's figures; a DataError (a bad label, header or cloud) before any is
    added, so that a bad sample is counted in `bad` alone."""
    label = checks.check_label(bytes(sample["cls"])) if "cls" in sample else None
    image = next((sample[e] for e in IMAGE_MEMBERS if e in sample), None)
    size = headers.check_header(bytes(image), MAX_PIXELS).upright_size() \
        if image is not None else None
    points = _points(sample)
    if label is not None:
        labels[label] += 1
    if size is not None:
        w, h = size
        found["width"].append(w)
        found["height"].append(h)
        found["aspect"].append(w / h)
    if points is not None:
        found["points"].append(points)
    text = next((sample[e] for e in TEXT_EXTS if e in sample), None)
    if text is not None:
        found["length"].append(len(bytes(text).decode("utf-8", "replace")))
    tokens = ds.source.tokens
    if tokens is not None and tokens.member in sample:
        found["tokens"].append(len(sample[tokens.member]) // (2 if tokens.dtype == "uint16" else 4))


def _points(sample: dict[str, Any]) -> int | None:
    cloud = next((e for e in POINTCLOUD_EXTS if e in sample), None)
    if cloud is None:
        return None
    from shardflow.samples import pointcloud_io

    try:
        return len(pointcloud_io.read_points(bytes(sample[cloud]), cloud))
    except pointcloud_io.PointCloudFormatError as exc:
        raise DataError(exc.reason, str(exc)) from None


def _summary(ds: ShardDataset, counted: int, found: dict[str, list[float]],
             labels: Counter[int], bad: Counter[str]) -> dict[str, Any]:
    names = {v: k for k, v in (ds.source.classes or {}).items()}
    out: dict[str, Any] = {"source": ds.source.describe(), "samples": len(ds),
                           "counted": counted, "modality": ds.source.modality,
                           "bad": dict(sorted(bad.items()))}
    if labels:
        out["classes"] = {names.get(k, str(k)): n for k, n in sorted(labels.items())}
    for name, values in found.items():
        if values:
            out[name] = _histogram(values)
    return out


def _histogram(values: list[float]) -> dict[str, Any]:
    """Bins drawn from the data: equal steps from its smallest to its largest value (whole
    numbers for whole-number data), so photos all 64 px wide are one bar at 64, not a bar
    "64-128" of a fixed scale."""
    array = np.asarray(values, np.float64)
    lo, hi = float(array.min()), float(array.max())
    if lo == hi:
        bins = [[_edge(lo), _edge(hi), len(array)]]
    else:
        edges = np.linspace(lo, hi, min(BINS, len(np.unique(array))) + 1)
        if np.all(array == np.round(array)):
            edges = np.unique(np.round(edges))
        counts, _ = np.histogram(array, bins=edges)
        bins = [[_edge(edges[i]), _edge(edges[i + 1]), int(counts[i])]
                for i in range(len(counts))]
    return {"min": lo, "median": float(np.median(array)), "max": hi,
            "mean": round(float(array.mean()), 3), "bins": bins}


def _edge(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value
