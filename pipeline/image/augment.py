"""Per-sample augmentation parameters, drawn in Python from (seed, epoch, key).

The random-resized-crop window and the flip of a sample depend only on the seed, the epoch
and the sample's key: not on the batch it lands in, the reader, the rank count, the thread
timing or a resume. The DALI graph receives them as inputs and decodes only the window
(region-of-interest decode). The image's size comes from its header, which is also where the
pixel limit is enforced, before anything is decoded.

EXIF orientation (phone photos are stored sideways with a tag saying how to turn them) is read
here too, from the JPEG APP1 segment or the PNG eXIf chunk. The window is drawn in the upright
frame, then mapped back to the stored pixels, which is what the decoder reads; the transpose
and flips that turn it upright are applied after the resize (resize.py, or the graph), where
the image is a square and they are exact. Every path applies the same parsed tag: DALI's own
`adjust_orientation` is left off, so no second EXIF parser can disagree with this one.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass
from typing import Any

from pipeline.errors import DataError

# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic...)
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_STANDALONE = {0x01, *range(0xD0, 0xD9)}
_PNG = b"\x89PNG\r\n\x1a\n"


# EXIF orientation -> (transpose, horizontal flip, vertical flip) that, applied to the stored
# pixels in that order, give the upright image: PIL's ImageOps.exif_transpose, tag by tag
# (5 TRANSPOSE, 6 ROTATE_270, 7 TRANSVERSE, 8 ROTATE_90).
ORIENTATIONS = {1: (False, False, False), 2: (False, True, False), 3: (False, True, True),
                4: (False, False, True), 5: (True, False, False), 6: (True, True, False),
                7: (True, True, True), 8: (True, False, True)}
_ORIENTATION_TAG = 0x0112


@dataclass(frozen=True)
class ImageHeader:
    """An image's size as stored and its EXIF orientation (1: upright, or no tag)."""

    width: int
    height: int
    orientation: int = 1

    def upright_size(self) -> tuple[int, int]:
        """(width, height) once turned upright: swapped by the orientations that transpose."""
        transpose = ORIENTATIONS[self.orientation][0]
        return (self.height, self.width) if transpose else (self.width, self.height)


def read_header(data: bytes) -> ImageHeader:
    """Size and orientation from a JPEG or PNG header; DataError for anything else."""
    if data[:2] == b"\xff\xd8":
        return _jpeg_header(data)
    if data[:8] == _PNG and len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return ImageHeader(width, height, _png_orientation(data))
    raise DataError("bad-image", "not a JPEG or PNG (no valid header)")


def header_size(data: bytes) -> tuple[int, int]:
    """(width, height) as stored, from a JPEG or PNG header; DataError for anything else."""
    header = read_header(data)
    return header.width, header.height


def _jpeg_header(data: bytes) -> ImageHeader:
    # Walks the segments up to the start of scan, as PIL does: an EXIF APP1 is normally
    # first, but one written after the frame header still counts for PIL.
    i, n, size, orientation = 2, len(data), None, None
    while i + 4 <= n:
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker == 0xDA:  # start of scan: no header segment follows
            break
        end = i + 2 + struct.unpack(">H", data[i + 2: i + 4])[0]
        if marker in _SOF and size is None and i + 9 <= n:
            height, width = struct.unpack(">HH", data[i + 5: i + 9])
            size = (width, height)
        elif marker == 0xE1 and orientation is None and data[i + 4: i + 10] == b"Exif\0\0":
            orientation = tiff_orientation(data[i + 10: end])  # the first EXIF block wins
        i = end
    if size is None:
        raise DataError("bad-image", "JPEG header has no frame size (truncated or corrupt)")
    return ImageHeader(*size, orientation or 1)


def _png_orientation(data: bytes) -> int:
    """The orientation in a PNG's eXIf chunk (before or after the image data, as PIL reads
    it); 1 without one. Only chunk headers are read: the walk skips over the data."""
    i, n = 8, len(data)
    while i + 8 <= n:
        length = struct.unpack(">I", data[i: i + 4])[0]
        kind = data[i + 4: i + 8]
        if kind == b"eXIf":
            exif = data[i + 8: i + 8 + length]
            return tiff_orientation(exif[6:] if exif.startswith(b"Exif\0\0") else exif)
        if kind == b"IEND":
            break
        i += 12 + length  # length, type, data, CRC
    return 1


def tiff_orientation(tiff: bytes) -> int:
    """The Orientation tag of the first IFD of an EXIF (TIFF) block: 1-8, or 1 when it is
    absent, out of range or unreadable (as PIL, which then leaves the image as stored)."""
    order = {b"II*\0": "<", b"MM\0*": ">"}.get(tiff[:4])
    if order is None or len(tiff) < 8:
        return 1
    ifd = struct.unpack(order + "I", tiff[4:8])[0]
    if ifd + 2 > len(tiff):
        return 1
    count = struct.unpack(order + "H", tiff[ifd: ifd + 2])[0]
    for at in range(ifd + 2, min(ifd + 2 + 12 * count, len(tiff) - 11), 12):
        tag, kind = struct.unpack(order + "HH", tiff[at: at + 4])
        if tag != _ORIENTATION_TAG:
            continue
        if kind == 3:  # SHORT, the type the standard gives it
            value = struct.unpack(order + "H", tiff[at + 8: at + 10])[0]
        elif kind == 4:  # LONG: off-standard, but PIL reads it
            value = struct.unpack(order + "I", tiff[at + 8: at + 12])[0]
        else:
            return 1
        return value if value in ORIENTATIONS else 1
    return 1


def check_header(data: bytes, max_pixels: int) -> ImageHeader:
    """The header, with the size checked against `max_pixels` before anything is decoded."""
    header = read_header(data)
    width, height = header.width, header.height
    if width < 1 or height < 1:
        raise DataError("bad-image", f"header declares a {width}x{height} image")
    if width * height > max_pixels:
        raise DataError("too-many-pixels", f"header declares {width}x{height} pixels, more "
                        f"than max_pixels={max_pixels}")
    return header


@dataclass(frozen=True)
class CropParams:
    """A crop window in pixels and a flip, for one sample. After `to_stored`, the window is in
    the stored pixels (what the decoder reads) and `transpose`, then `vflip` and `flip`
    (horizontal), turn the resized window upright and mirror it when training."""

    x: int
    y: int
    width: int
    height: int
    flip: bool
    transpose: bool = False
    vflip: bool = False


@dataclass(frozen=True)
class MaskedCrop(CropParams):
    """A sample's window with its masks' windows (image_loader's `targets`), each cut from
    the decoded mask in the reader stage (H, W), as stored: resized and turned with the image
    (resize.mask_batch)."""

    masks: tuple[Any, ...] = ()


def random_resized_crop(rng: random.Random, width: int, height: int,
                        scale: tuple[float, float], ratio: tuple[float, float],
                        flip_probability: float = 0.5) -> CropParams:
    """The window of torchvision's RandomResizedCrop (`random_window`), then the flip."""
    x, y, w, h = random_window(rng, width, height, scale, ratio)
    return CropParams(x, y, w, h, rng.random() < flip_probability)


def random_window(rng: random.Random, width: int, height: int, scale: tuple[float, float],
                  ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """(x, y, w, h) of torchvision's RandomResizedCrop: area fraction in `scale`, aspect
    ratio (log-uniform) in `ratio`; ten tries, then the largest central window within
    `ratio`."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    w, h = _central(width, height, ratio)
    return (width - w) // 2, (height - h) // 2, w, h


def _central(width: int, height: int, ratio: tuple[float, float]) -> tuple[int, int]:
    aspect = width / height
    if aspect < ratio[0]:
        return width, max(1, round(width / ratio[0]))
    if aspect > ratio[1]:
        return max(1, round(height * ratio[1])), height
    return width, height


def center_crop(width: int, height: int, crop_fraction: float) -> CropParams:
    """The evaluation window: a centred square, `crop_fraction` of the shorter side (the same
    pixels as resizing the shorter side to size / crop_fraction and cropping size x size)."""
    side = max(1, round(min(width, height) * crop_fraction))
    return CropParams((width - side) // 2, (height - side) // 2, side, side, False)


def to_stored(window: CropParams, orientation: int, width: int, height: int) -> CropParams:
    """`window`, drawn in the upright frame of an image stored as `width` x `height` with EXIF
    `orientation`, as the stored-frame window to decode plus the transpose and flips that
    turn the decoded window upright (the training flip, drawn upright, folded in)."""
    transpose, hflip, vflip = ORIENTATIONS[orientation]
    x, y, w, h = window.x, window.y, window.width, window.height
    up_width, up_height = (height, width) if transpose else (width, height)
    # Upright = flips(transpose(stored)): undo the flips in the transposed frame, then the
    # transpose; a rectangle maps to a rectangle, so the crop commutes with all three.
    if vflip:
        y = up_height - y - h
    if hflip:
        x = up_width - x - w
    if transpose:
        x, y, w, h = y, x, h, w
    return CropParams(x, y, w, h, window.flip != hflip, transpose, vflip)
