"""The portable backend's image stage (no DALI): each sample's window decoded by PIL in a
thread pool, then resized, turned upright, flipped and laid out by resize.py, exactly as the
DALI backend's CPU path does after its region-of-interest decode.

    encoded bytes, the window in the stored frame (loader.py: augment.py's crop, to_stored)
      -> PIL (JPEG, PNG, WebP, BMP, TIFF), decode, crop the window, RGB: the very pixels DALI's
         window decode gives (both are libjpeg-turbo; measured bit-exact batches)
         or, where the window is at least 4x `size` on both sides: `draft` asks libjpeg
         for a 1/2, 1/4 or 1/8 scale decode (in the DCT domain: most of the work of a large
         photo is never done), leaving the window HEADROOM (2) x `size` or more, and PIL
         resizes it to size
         (a JPEG is decoded down to the window's last row, rows.py, and, where it has
         restart markers, from the last one above the window, restarts.py)
      -> resize.batch: the torch resize, EXIF turn and flip of the DALI backend's CPU path

The EXIF orientation is not applied by PIL here: the window is in the stored pixels and
resize.py turns it upright from the tag augment.py parsed, the one parser both backends use,
so both agree with `ImageOps.exif_transpose` (tests/test_portable.py checks all three).
PIL decodes where DALI decodes only the window, so this backend is slower per image on large
photos whose crops are small; the draft scale makes up for it where crops are large.
"""

from __future__ import annotations

import dataclasses
import io
import math
import struct
from typing import Any

import numpy as np
from PIL import Image

from shardflow.errors import DataError
from shardflow.image import restarts, rows
from shardflow.image.augment import CropParams
from shardflow.image.batchops import BatchOps
from shardflow.image.config import ImageConfig
from shardflow.image.decode import ImageStage, Item
from shardflow.loading.portablestage import ThreadBackend
from shardflow.loading.readers import Placement
from shardflow.samples import headers
from shardflow.samples.headers import ORIENTATIONS

# What the reader stage lets through (headers.read_header): JPEG, PNG, WebP, BMP, TIFF. (An
# MPO opens as JPEG: PIL's JPEG plugin hands it to its MPO reader, which gives the first image.)
FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "TIFF")
SCALES = (8, 4, 2)  # the scales libjpeg decodes at in the DCT domain, largest first
# A drafted window keeps at least HEADROOM x `size` pixels on both sides, so PIL's
# antialiased resize still reduces it 2x or more. At 1x (a 1/8 draft left barely `size`) the
# DCT's 8x8 block average stood in for the resize filter: mean |difference| to DALI's pixels
# up to 5.1 per image and 85 at a pixel (photos of 128-416 px at 32-128); at 2x, 1.7 and 28
# at most, for a fifth to a quarter of the rate on large photos (docs/portable.md).
HEADROOM = 2


class PortableImageStage(ImageStage):
    """Decodes with PIL in `threads` threads (PIL releases the GIL while it decodes: a
    ThreadBackend); the batch is built as the DALI stage builds it after a CPU decode
    (ImageStage)."""

    cut = True  # JPEGs decoded down to the window's last row (rows.py); False: every row

    def __init__(self, cfg: ImageConfig, placement: Placement, batch_ops: BatchOps | None
                 ) -> None:
        super().__init__(cfg, placement, batch_ops)
        self.backend = ThreadBackend(self, cfg.threads)

    def _decode_one(self, data: np.ndarray, window: Any) -> Any:
        """The window's pixels; with views, each view's window (a tuple), at its size."""
        try:
            if self.views is not None:
                return [decode_window(data, w, view.size, cut=self.cut)
                        for w, view in zip(window, self.views, strict=True)]
            return decode_window(data, window, self.cfg.size, cut=self.cut)
        except (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error,
                Image.DecompressionBombError) as exc:  # what Pillow raises on bad data
            # The reason the DALI backend gives a sample its graph refuses: PIL's full check
            # names it (bad-image, too-many-pixels...); if that passes, the window decode
            # failed on its own, still a bad image.
            self._check(data.tobytes())
            raise DataError(self.what, f"PIL cannot decode it: {exc}") from None

    def _assemble(self, item: Item, decoded: list[Any]) -> Any:
        return self._resized(decoded, item[2])


def decode_window(data: Any, window: CropParams, size: int, draft: bool = True,
                  cut: bool = True) -> np.ndarray:
    """The window (stored frame) of an encoded JPEG or PNG as HWC uint8 RGB: as stored (the
    same pixels as DALI's window decode), or, with `draft` where the window is at least 4x
    `size` on both sides, already resized to size x size from a JPEG decoded at 1/2, 1/4 or
    1/8 scale, the largest that leaves it HEADROOM x `size` (resize.py's resize of it is then
    the identity). With `cut`, a JPEG is decoded down to the last row the window reads, not
    below: the same pixels (rows.py); and where it has restart markers, from the last one
    above the window: the same rows, and the same drafted window (restarts.py)."""
    # One copy of the bytes: BytesIO shares a bytes object, and rows.py feeds a view of it.
    data = data if isinstance(data, bytes) else bytes(data)
    if cut:
        below = _below_restart(data, window, size, draft)
        if below is not None:
            return below
    return _from_the_top(data, window, size, draft, cut)


def _from_the_top(data: bytes, window: CropParams, size: int, draft: bool, cut: bool
                  ) -> np.ndarray:
    """decode_window without the restart cut."""
    with Image.open(io.BytesIO(data), formats=FORMATS) as img:
        if img.format == "TIFF":
            img = _as_stored(img, headers.read_header(bytes(data)).orientation)
        scale = draft_scale(window, size) if draft else 1
        if scale > 1 and img.draft("RGB", (img.width // scale, img.height // scale)) is not None:
            # The window's edges fall inside scaled pixels: PIL's resize takes a fractional
            # box (measured: mean |difference| to DALI's pixels 0.9, against 1.9 when the
            # box is rounded to whole scaled pixels). Its filter is torch's (antialiased
            # bilinear), which is why this can skip resize.py's.
            box = (window.x / scale, window.y / scale, (window.x + window.width) / scale,
                   (window.y + window.height) / scale)
            # Cut to the scaled pixels the box touches, as resize.py resizes the window
            # alone: PIL's filter would otherwise read past the box, into the photo around
            # the window (measured at 32-64 px: largest difference to DALI's 16-25, against
            # 24-29 reading past it), and no row below the window need be decoded.
            left, top = math.floor(box[0]), math.floor(box[1])
            right, bottom = math.ceil(box[2]), math.ceil(box[3])
            if cut and rows.load_rows(img, bottom, data) is False:
                return _from_the_top(data, window, size, draft, cut=False)
            img = img.crop((left, top, min(right, img.width), min(bottom, img.height)))
            box = (box[0] - left, box[1] - top, box[2] - left, box[3] - top)
            return _rgb(_as_rgb(img).resize((size, size), Image.Resampling.BILINEAR, box=box))
        right, bottom = window.x + window.width, window.y + window.height
        if cut and rows.load_rows(img, bottom, data) is False:
            return _from_the_top(data, window, size, draft, cut=False)
        return _rgb(img.crop((window.x, window.y, right, bottom)))


def _below_restart(data: bytes, window: CropParams, size: int, draft: bool
                   ) -> np.ndarray | None:
    """The window decoded from the restart marker above it (restarts.py), or None where
    there is none, or the file is cut short or does not decode from there (the caller then
    decodes it from the top, which raises as before)."""
    scale = draft_scale(window, size) if draft else 1
    # The first row PIL reads: the window's top, in whole scaled rows (a drafted window is
    # cut to the scaled pixels it touches before its resize: _from_the_top), and one more.
    first = max(0, math.floor(window.y / scale) - 1) * scale
    found = restarts.cut_above(data, first)
    if found is None or not headers.whole_jpeg(data):
        return None
    moved = dataclasses.replace(window, y=window.y - found.top)
    try:
        return _from_the_top(found.data, moved, size, draft, cut=True)
    except (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error):
        return None


def _as_stored(img: Image.Image, orientation: int) -> Image.Image:
    """A TIFF's pixels as stored: PIL's TIFF plugin turns them upright as it loads them (the
    other formats it leaves as stored), so its turn is undone, exactly, in reverse order."""
    transpose, hflip, vflip = ORIENTATIONS[orientation]
    for on, how in ((vflip, Image.Transpose.FLIP_TOP_BOTTOM),
                    (hflip, Image.Transpose.FLIP_LEFT_RIGHT),
                    (transpose, Image.Transpose.TRANSPOSE)):
        if on:
            img = img.transpose(how)
    return img


def draft_scale(window: CropParams, size: int) -> int:
    """The largest DCT scale (1/8, 1/4, 1/2) at which the window is still HEADROOM x `size`
    pixels or more on both sides; 1 when even 1/2 leaves less."""
    least = HEADROOM * size
    for scale in SCALES:
        if window.width // scale >= least and window.height // scale >= least:
            return scale
    return 1


def _as_rgb(img: Image.Image) -> Image.Image:
    """A drafted JPEG (RGB, L or CMYK) in RGB, for PIL's resize to work on."""
    return img if img.mode == "RGB" else img.convert("RGB")


def _rgb(img: Image.Image) -> np.ndarray:
    """HWC uint8 RGB as DALI's decoder gives it: alpha dropped (not blended), gray repeated,
    16-bit samples scaled to 8 bits by their high byte."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        gray = (np.asarray(img, dtype=np.uint32) >> 8).clip(0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    # np.array, not asarray: PIL's array is read-only, and torch wants to own a writable one.
    return np.array(_as_rgb(img))
