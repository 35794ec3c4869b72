"""Per-sample augmentation parameters, drawn in Python from (seed, epoch, key).

The random-resized-crop window and the flip of a sample depend only on the seed, the epoch
and the sample's key: not on the batch it lands in, the reader, the rank count, the thread
timing or a resume. The DALI graph receives them as inputs and decodes only the window
(region-of-interest decode). The image's size comes from its header, which is also where the
pixel limit is enforced, before anything is decoded.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass

from pipeline.errors import DataError

# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic...)
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_STANDALONE = {0x01, *range(0xD0, 0xD9)}
_PNG = b"\x89PNG\r\n\x1a\n"


def header_size(data: bytes) -> tuple[int, int]:
    """(width, height) read from a JPEG or PNG header; DataError for anything else."""
    if data[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    if data[:8] == _PNG and len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return width, height
    raise DataError("bad-image", "not a JPEG or PNG (no valid header)")


def _jpeg_size(data: bytes) -> tuple[int, int]:
    i, n = 2, len(data)
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
        if marker in _SOF and i + 9 <= n:
            height, width = struct.unpack(">HH", data[i + 5: i + 9])
            return width, height
        if marker == 0xDA:  # start of scan before any frame header
            break
        i += 2 + struct.unpack(">H", data[i + 2: i + 4])[0]
    raise DataError("bad-image", "JPEG header has no frame size (truncated or corrupt)")


def check_pixels(data: bytes, max_pixels: int) -> tuple[int, int]:
    width, height = header_size(data)
    if width < 1 or height < 1:
        raise DataError("bad-image", f"header declares a {width}x{height} image")
    if width * height > max_pixels:
        raise DataError("too-many-pixels", f"header declares {width}x{height} pixels, more "
                        f"than max_pixels={max_pixels}")
    return width, height


@dataclass(frozen=True)
class CropParams:
    """A crop window in pixels and a flip, for one sample."""

    x: int
    y: int
    width: int
    height: int
    flip: bool


def random_resized_crop(rng: random.Random, width: int, height: int,
                        scale: tuple[float, float], ratio: tuple[float, float],
                        flip_probability: float = 0.5) -> CropParams:
    """The window of torchvision's RandomResizedCrop: area fraction in `scale`, aspect ratio
    (log-uniform) in `ratio`; ten tries, then the largest central window within `ratio`."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            x, y = rng.randint(0, width - w), rng.randint(0, height - h)
            return CropParams(x, y, w, h, rng.random() < flip_probability)
    w, h = _central(width, height, ratio)
    return CropParams((width - w) // 2, (height - h) // 2, w, h, rng.random() < flip_probability)


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
