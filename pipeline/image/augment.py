"""Per-sample augmentation parameters, drawn in Python from (seed, epoch, key).

The random-resized-crop window and the flip of a sample depend only on the seed, the epoch
and the sample's key: not on the batch it lands in, the reader, the rank count, the thread
timing or a resume. The DALI graph receives them as inputs and decodes only the window
(region-of-interest decode). The image's size comes from its header, which is also where the
pixel limit is enforced, before anything is decoded (headers.py).

EXIF orientation (phone photos are stored sideways with a tag saying how to turn them) is read
with the size (headers.py). The window is drawn in the upright frame, then mapped back to the
stored pixels, which is what the decoder reads; the transpose and flips that turn it upright
are applied after the resize (resize.py, or the graph), where the image is a square and they
are exact. Every path applies the same parsed tag: DALI's own `adjust_orientation` is left
off, so no second EXIF parser can disagree with this one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from shardflow.samples.headers import ORIENTATIONS


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
