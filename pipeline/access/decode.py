"""One sample's members made into values, with the checks the loaders make: what
`ShardDataset[i]` returns when it decodes.

    image       the first image member (JPEG, PNG, WebP, BMP, TIFF; header checked against
                max_pixels first), decoded as the portable backend decodes it, turned upright
                by its EXIF orientation (the one parser both backends use): uint8 (H, W, 3)
    text        `.txt` checked UTF-8 (str); stored token ids checked against the vocabulary
                (int32 array)
    pointcloud  the first cloud member parsed and checked: float32 (N, C), x y z first
    .cls        checked as the loaders check it (int), against the manifest's classes
    .json/.txt  besides the data: parsed JSON / str; anything else stays bytes

Bad data raises DataError naming the reason; the caller adds shard and key.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pipeline.errors import DataError
from pipeline.samples import checks, headers, pointcloud_io
from pipeline.samples.checks import IMAGE_MEMBERS, POINTCLOUD_EXTS, TEXT_EXTS
from pipeline.shards.manifest import TokenForm

MAX_PIXELS = 64_000_000  # as image_loader's max_pixels


def decoded(sample: dict[str, bytes], modality: str | None, tokens: TokenForm | None,
            classes: int | None, max_pixels: int = MAX_PIXELS) -> dict[str, Any]:
    """The sample's values by member name, plus "__key__"; the data member under the
    modality's name ("image", "text", "tokens", "points")."""
    out: dict[str, Any] = {}
    data_ext = _data_member(sample, modality, tokens)
    for ext, raw in sample.items():
        if ext.startswith("__"):
            out[ext] = raw
        elif ext == data_ext:
            name, value = _data(raw, ext, modality, tokens, max_pixels)
            out[name] = value
        elif ext == "cls":
            out["label"] = checks.check_label(raw, classes)
        else:
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
        from pipeline.text import pretokenized

        return "tokens", pretokenized.ids_of(raw, tokens)
    if modality == "text":
        return "text", checks.text_of(raw)
    try:
        return "points", pointcloud_io.read_points(raw, ext)
    except pointcloud_io.PointCloudFormatError as exc:
        raise DataError("bad-points", str(exc)) from None


def image(data: bytes, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """An encoded image as upright uint8 (H, W, 3): the portable backend's decode of the
    whole image, then its EXIF orientation."""
    from pipeline.image.augment import CropParams
    from pipeline.image.portable import decode_window

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
