"""One sample's members made into values, with the checks the loaders make: what
`ShardDataset[i]` returns when it decodes.

    image       the first image member (JPEG, PNG, WebP, BMP, TIFF; header checked against
                max_pixels first), decoded as the portable backend decodes it, turned upright
                by its EXIF orientation (the one parser both backends use): uint8 (H, W, 3)
    text        `.txt` checked UTF-8 (str); stored token ids checked against the vocabulary
                (int32 array)
    pointcloud  the first cloud member parsed and checked as the point-cloud loader checks it
                (x, y, z finite, the reader's reasons): "points" float32 (N, C), x y z first;
                "offset" float64 (3,), zeros unless points + offset are the file's coordinates
                (make_shards' KEY.offset.npy, one taken from a float64 cloud far from the
                origin, or their sum: batch.offset's values); "labels" (a scene's
                KEY.labels.npy, checked against the points and the manifest's classes)
    .cls        checked as the loaders check it (int), against the manifest's classes
    .json/.txt  besides the data: parsed JSON / str; anything else stays bytes

Bad data raises DataError naming the reason; the caller adds shard and key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardflow.errors import DataError
from shardflow.samples import checks, headers, jpegscan, pointcloud_io
from shardflow.samples.checks import IMAGE_MEMBERS, OFFSET_EXT, POINTCLOUD_EXTS, TEXT_EXTS
from shardflow.samples.scans import LABELS_EXT, NO_IGNORE, check_labels
from shardflow.shards.manifest import TokenForm

MAX_PIXELS = 64_000_000  # as image_loader's max_pixels


def decoded(sample: dict[str, bytes], modality: str | None, tokens: TokenForm | None,
            classes: int | None, max_pixels: int = MAX_PIXELS,
            segmentation: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The sample's values by member name, plus "__key__"; the data member under the
    modality's name ("image", "text", "tokens", "points"). `segmentation`: the manifest's
    section of scenes labelled per point (classes, ignore label), or None."""
    out: dict[str, Any] = {}
    data_ext = _data_member(sample, modality, tokens)
    cloud = modality == "pointcloud"
    for ext, raw in sample.items():
        if ext.startswith("__"):
            out[ext] = raw
        elif ext == data_ext and cloud:
            out.update(cloud_values(sample, ext, segmentation))
        elif ext == data_ext:
            name, value = _data(raw, ext, modality, tokens, max_pixels)
            out[name] = value
        elif ext == "cls":
            out["label"] = checks.check_label(raw, classes)
        elif not (cloud and ext in (OFFSET_EXT, LABELS_EXT)):  # those go with the points
            out[ext] = _small(raw, ext)
    return out


def _data_member(sample: dict[str, bytes], modality: str | None,
                 tokens: TokenForm | None) -> str | None:
    wanted = {"image": IMAGE_MEMBERS, "text": (tokens.member,) if tokens else TEXT_EXTS,
              "pointcloud": POINTCLOUD_EXTS}.get(modality or "", ())
    found = next((ext for ext in wanted if ext in sample), None)
    if wanted and found is None:
        raise DataError("missing-field", f"no {modality} member among {sorted(sample)}")
    return found


def _data(raw: bytes, ext: str, modality: str | None, tokens: TokenForm | None,
          max_pixels: int) -> tuple[str, Any]:
    if modality == "image":
        return "image", image(raw, max_pixels)
    if modality == "text" and tokens is not None:
        from shardflow.text import pretokenized

        return "tokens", pretokenized.ids_of(raw, tokens)
    return "text", checks.text_of(raw)


def cloud_values(sample: dict[str, bytes], ext: str, segmentation: Mapping[str, Any] | None
                 ) -> dict[str, Any]:
    """"points", "offset" and, for a scene, "labels" of a cloud sample, with the point-cloud
    loader's checks and reasons. The offset is returned, not added to the points: float32
    would round coordinates far from the origin (pointcloud_io.precision_offset)."""
    try:
        points, taken = pointcloud_io.read_points_offset(bytes(sample[ext]), ext)
    except pointcloud_io.PointCloudFormatError as exc:
        raise DataError(exc.reason, str(exc)) from None
    offset = checks.check_offset(bytes(sample[OFFSET_EXT])) if OFFSET_EXT in sample \
        else np.zeros(3)
    out = {"points": points, "offset": offset if taken is None else offset + taken}
    if LABELS_EXT in sample or segmentation:  # scenes: the loader refuses one without labels
        seg = segmentation or {}
        ignore = seg.get("ignore_label")
        out["labels"] = check_labels(sample.get(LABELS_EXT), len(points),
                                     seg.get("num_classes"),
                                     NO_IGNORE if ignore is None else int(ignore))
    return out


def image(data: bytes, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """An encoded image as upright uint8 (H, W, 3): the portable backend's decode of the
    whole image, then its EXIF orientation."""
    from shardflow.image.augment import CropParams
    from shardflow.image.portable import decode_window

    data = jpegscan.readable(data)  # a header the loaders repair, repaired alike
    header = headers.check_header(data, max_pixels)
    whole = CropParams(0, 0, header.width, header.height, flip=False)
    try:
        pixels = decode_window(data, whole, max(header.width, header.height), draft=False)
    except (OSError, ValueError, SyntaxError) as exc:  # what PIL raises on damaged data
        raise DataError("bad-image", f"does not decode: {exc}") from None
    transpose, hflip, vflip = headers.ORIENTATIONS[header.orientation]
    if transpose:
        pixels = pixels.transpose(1, 0, 2)
    if hflip:
        pixels = pixels[:, ::-1]
    if vflip:
        pixels = pixels[::-1]
    return np.ascontiguousarray(pixels)


def _small(raw: bytes, ext: str) -> Any:
    last = ext.rsplit(".", 1)[-1].lower()
    if last == "json":
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise DataError("bad-json", f".{ext} is not JSON: {exc}") from None
    if last == "txt":
        return checks.text_of(raw)
    return raw
