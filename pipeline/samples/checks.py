"""Checks of one sample's content: images decode, text is clean UTF-8, clouds are finite.

Used by make_shards (nothing bad reaches a shard) and verify_shards (nothing bad stayed in
one). Every failure is a DataError with a short reason code; nothing from the data is
executed: pickle members are refused by name and `.npy` is loaded with allow_pickle=False.
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image

from pipeline.errors import DataError
from pipeline.samples import pointcloud_io

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif", "ppm", "pgm")
POINTCLOUD_EXTS = ("npy", "ply", "off", "xyz")
TEXT_EXTS = ("txt",)
PICKLE_EXTS = ("pyd", "pkl", "pickle", "pth", "pt", "ckpt", "joblib")
# Formats that DALI decodes and that we keep byte for byte; others are re-encoded to PNG.
KEEP_FORMATS = {"JPEG": "jpg", "PNG": "png"}


@dataclass(frozen=True)
class CheckLimits:
    """Bounds applied before allocating: pixels per image, bytes per text, points per cloud."""

    max_pixels: int = 64_000_000
    max_text_bytes: int = 16 * 1024 * 1024
    max_points: int = 2_000_000

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_text_bytes", "max_points"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be a positive integer")


def check_image(data: bytes, limits: CheckLimits) -> str:
    """Fully decode an image (pixel limit checked from the header first); returns PIL's format."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > limits.max_pixels:
                raise DataError("too-many-pixels", f"image declares {width}x{height} pixels, "
                                f"more than max_pixels={limits.max_pixels}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img.load()
            return str(img.format)
    except DataError:
        raise
    except Image.DecompressionBombError as exc:
        raise DataError("too-many-pixels", str(exc)) from None
    except Image.UnidentifiedImageError:
        raise DataError("bad-image", "not an image in any format PIL knows") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise DataError("bad-image", f"image does not decode: {exc}") from None


def reencode_png(data: bytes) -> bytes:
    """Lossless PNG of an image in a format DALI does not take everywhere (GIF, BMP, TIFF...)."""
    with Image.open(io.BytesIO(data)) as img:
        if img.mode not in ("RGB", "RGBA", "L", "LA", "I;16"):
            img = img.convert("RGBA" if "A" in img.getbands() else "RGB")
        out = io.BytesIO()
        img.save(out, format="PNG")
        return out.getvalue()


def check_text(data: bytes, limits: CheckLimits) -> str:
    if len(data) > limits.max_text_bytes:
        raise DataError("text-too-large", f"document has {len(data)} bytes, more than "
                        f"max_text_bytes={limits.max_text_bytes}; split it or raise the limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError("bad-utf8", f"not valid UTF-8 at byte {exc.start}") from None
    if "\x00" in text:
        raise DataError("nul-byte", f"text holds a NUL byte at character {text.index(chr(0))}")
    if not text.strip():
        raise DataError("empty-text", "document is empty or only whitespace")
    return text


def check_points(data: bytes, ext: str, limits: CheckLimits) -> bytes:
    """Parse a point cloud and return it as `.npy` bytes of float32 (N, C)."""
    try:
        points = pointcloud_io.read_points(data, ext, max_points=limits.max_points)
    except pointcloud_io.PointCloudFormatError as exc:
        raise DataError(exc.reason, str(exc)) from None
    out = io.BytesIO()
    import numpy as np

    np.save(out, points, allow_pickle=False)
    return out.getvalue()


_LABEL = re.compile(rb"\s*([+-]?[0-9]+)\s*")  # ASCII digits; \s is ASCII whitespace for bytes


def check_label(data: bytes, num_classes: int | None = None) -> int:
    """A `.cls` member: ASCII decimal integer, within [0, num_classes) when that is known."""
    # Stricter than int(): it would take "1_000" and non-ASCII digits, and labels past int64
    # would overflow the batch's label tensor.
    found = _LABEL.fullmatch(data) if len(data) <= 64 else None
    if found is None:
        raise DataError("bad-label", f"label {data[:40]!r} is not an integer")
    label = int(found.group(1))
    if not -(2**63) <= label < 2**63:
        raise DataError("label-out-of-range", f"label {data[:40]!r} does not fit in int64")
    if label < 0 or (num_classes is not None and label >= num_classes):
        bound = f"[0, {num_classes})" if num_classes is not None else ">= 0"
        raise DataError("label-out-of-range", f"label {label} is not in {bound}")
    return label


def check_member(ext: str, data: bytes, limits: CheckLimits, num_classes: int | None) -> None:
    """Check one stored member by its extension; unknown extensions pass as opaque bytes."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last in PICKLE_EXTS:
        raise DataError("pickle-member", f"member .{ext} is a pickle; shardflow never "
                        "unpickles sample data")
    if last in IMAGE_EXTS:
        check_image(data, limits)
    elif last in TEXT_EXTS:
        check_text(data, limits)
    elif last == "npy":
        check_points(data, "npy", limits)
    elif last == "cls":
        check_label(data, num_classes)


def check_sample(sample: dict[str, object], limits: CheckLimits,
                 num_classes: int | None = None) -> None:
    """Check every member of a sample; the error carries the sample's key and URL."""
    key, url = str(sample.get("__key__", "")), str(sample.get("__url__", ""))
    for ext, data in sample.items():
        if ext.startswith("__"):
            continue
        try:
            check_member(ext, data, limits, num_classes)  # type: ignore[arg-type]
        except DataError as err:
            raise err.located(source=url, key=key) from None
