"""Segmentation masks stored beside an image: one rule for converter, verify and loaders.

A mask is a label map, one value a pixel: a PNG in mode L or P (values 0..255: a P mask's
palette indices are its labels, as in Pascal VOC) or 16-bit grey (I;16: up to 65535
classes). It is the size of its image as stored, and aligned with the stored pixels: the
loader turns both upright by the image's EXIF orientation, crops both with the same window
and flips both. It is lossless by construction (PNG); a JPEG mask is refused (its edges would
be new labels). make_shards stores it as `KEY.seg.png`.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

from shardflow.errors import DataError

MASK_EXT = "seg.png"  # the member make_shards writes; loaders may name another
LABEL_MODES = ("L", "P", "I;16", "I;16B", "I;16L", "1")
LOSSLESS = ("PNG", "BMP", "TIFF", "GIF", "PPM")  # PIL's names of what a mask may come as


def check_mask(data: bytes, size: tuple[int, int]) -> None:
    """DataError unless `data` is a PNG label map of `size` (width, height): read from the
    header first (nothing decoded for a mask of another size), then decoded fully."""
    read_mask(data, size)


def read_mask(data: bytes, size: tuple[int, int]) -> np.ndarray:
    """`check_mask`'s check, and the label map it decoded (H, W): uint8 for 8-bit masks,
    int32 for 16-bit ones."""
    with _open(data) as img:
        if img.format != "PNG":
            raise DataError("bad-mask", f"mask is {img.format}, not PNG (make_shards stores "
                            "masks as PNG)")
        _check_opened(img, size)
        if img.mode.startswith("I"):
            return np.asarray(img, dtype=np.int32)
        return np.array(img, dtype=np.uint8)  # mode 1: 0 and 1 (convert("L") gives 255)


def prepare_mask(data: bytes, size: tuple[int, int]) -> bytes:
    """What make_shards stores for a mask file: PNG bytes as they are, another lossless
    format re-encoded as PNG with the same values; DataError for a lossy, colour or
    mis-sized one."""
    with _open(data) as img:
        if img.format not in LOSSLESS:
            raise DataError("bad-mask", f"mask is {img.format}: masks must be lossless (PNG, "
                            "BMP, TIFF, GIF, PPM/PGM); a JPEG changes the labels at edges")
        _check_opened(img, size)
        if img.format == "PNG":
            return data
        out = io.BytesIO()
        if img.mode == "1":  # labels 0 and 1, as the loader reads a 1-bit PNG
            img = Image.fromarray(np.asarray(img, dtype=np.uint8), "L")
        img.save(out, format="PNG")
        return out.getvalue()


def read_values(data: bytes, size: tuple[int, int]) -> np.ndarray:
    """A map of continuous values (depth, a height field) of the image's stored `size`
    (width, height), as float32 (H, W): a 2-D numeric `.npy` (never unpickled) or a grey PNG
    (8 or 16 bit: its values as they are). DataError naming what is wrong."""
    if bytes(data[:6]) == b"\x93NUMPY":
        try:
            values = np.load(io.BytesIO(bytes(data)), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise DataError("bad-values", f"not a numpy array: {exc}") from None
        if values.ndim != 2 or values.dtype.kind not in "iuf":
            raise DataError("bad-values", f"array is {values.dtype} {values.shape}, not a "
                            "2-D numeric map")
        if values.shape != (size[1], size[0]):
            raise DataError("mask-size", f"map is {values.shape[1]}x{values.shape[0]}, its "
                            f"image {size[0]}x{size[1]}")
        return values.astype(np.float32)
    with _open(data) as img:
        if img.format != "PNG":
            raise DataError("bad-values", f"map is {img.format}: a value map is .npy or a grey "
                            "PNG")
        _check_opened(img, size)
        return np.asarray(img, dtype=np.float32)


def _open(data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except (Image.UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise DataError("bad-mask", "mask is not an image PIL reads") from None


def _check_opened(img: Image.Image, size: tuple[int, int]) -> None:
    if img.mode not in LABEL_MODES:
        raise DataError("bad-mask", f"mask has mode {img.mode}; a label map is one value a "
                        "pixel (L, P or 16-bit grey), not colours")
    if img.size != tuple(size):
        turned = " (the image's size turned: masks align with the stored pixels, before the " \
            "EXIF orientation is applied)" if img.size == tuple(size)[::-1] else ""
        raise DataError("mask-size", f"mask is {img.size[0]}x{img.size[1]}, its image "
                        f"{size[0]}x{size[1]}{turned}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise DataError("bad-mask", f"mask does not decode: {exc}") from None
