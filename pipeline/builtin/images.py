"""Learnable toy image classes for smoke tests, examples and tiny training runs.

``make_image_folder`` draws ten shape and texture classes (circle, square, triangle, stripes in
three directions, checkerboard, cross, ring, dots) with random position, scale, colours and
background noise, and writes them as an ImageNet-style folder ``out/<class>/<class>_<i>.jpg``.
A small CNN separates the classes within a minute on a laptop CPU, yet no class is a constant
image. Every 20th image is a PNG so that readers exercise both decoders.

The module also holds the two helpers the other generators share: ``fresh_out_dir`` and
``save_image``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

CLASSES = (
    "00_circle",
    "01_square",
    "02_triangle",
    "03_hstripes",
    "04_vstripes",
    "05_checker",
    "06_cross",
    "07_ring",
    "08_dstripes",
    "09_dots",
)
PNG_EVERY = 20
JPEG_QUALITY = 90

# A mask function maps pixel offsets (x, y) from the shape centre, a radius r in pixels and the
# item's generator to a coverage mask in [0, 1].
MaskFn = Callable[[np.ndarray, np.ndarray, float, np.random.Generator], np.ndarray]


def fresh_out_dir(out: str | Path) -> Path:
    """Create ``out`` (with parents) and return it as a Path.

    Raises ValueError if ``out`` already holds files, so a generator never mixes its output with
    an older dataset.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output folder {out} is not empty; pass a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def save_image(pixels: np.ndarray, path: Path, quality: int = JPEG_QUALITY) -> int:
    """Write an HxWx3 uint8 array as JPEG or PNG (chosen by suffix); return the file size."""
    image = Image.fromarray(pixels, "RGB")
    if path.suffix == ".png":
        image.save(path, format="PNG")
    else:
        image.save(path, format="JPEG", quality=quality)
    return path.stat().st_size


def _soft(distance: np.ndarray) -> np.ndarray:
    # Signed distance in pixels -> coverage with a one-pixel ramp, a cheap anti-aliasing that
    # keeps edges from being perfectly binary.
    return np.clip(0.5 - distance, 0.0, 1.0)


def _rotate(x: np.ndarray, y: np.ndarray, angle: float) -> tuple[np.ndarray, np.ndarray]:
    c, s = np.cos(angle), np.sin(angle)
    return c * x + s * y, -s * x + c * y


def _circle(x: np.ndarray, y: np.ndarray, r: float, rng: np.random.Generator) -> np.ndarray:
    return _soft(np.hypot(x, y) - r)


def _square(x: np.ndarray, y: np.ndarray, r: float, rng: np.random.Generator) -> np.ndarray:
    # Only a small tilt, so squares stay distinct from the diagonal-ish cross and triangle.
    u, v = _rotate(x, y, rng.uniform(-0.3, 0.3))
    return _soft(np.maximum(np.abs(u), np.abs(v)) - 0.8 * r)


def _triangle(x: np.ndarray, y: np.ndarray, r: float, rng: np.random.Generator) -> np.ndarray:
    angles = rng.uniform(0, 2 * np.pi) + np.array([0.0, 2.0, 4.0]) * np.pi / 3
    # Intersection of three half-planes whose normals are 120 degrees apart.
    edges = [np.cos(a) * x + np.sin(a) * y for a in angles]
    return _soft(np.maximum.reduce(edges) - 0.55 * r)


def _cross(x: np.ndarray, y: np.ndarray, r: float, rng: np.random.Generator) -> np.ndarray:
    u, v = _rotate(x, y, rng.uniform(-0.3, 0.3))
    arm = 0.25 * r
    bar_h = np.maximum(np.abs(u) - r, np.abs(v) - arm)
    bar_v = np.maximum(np.abs(u) - arm, np.abs(v) - r)
    return _soft(np.minimum(bar_h, bar_v))


def _ring(x: np.ndarray, y: np.ndarray, r: float, rng: np.random.Generator) -> np.ndarray:
    return _soft(np.abs(np.hypot(x, y) - r) - rng.uniform(0.12, 0.25) * r)


def _stripes(t: np.ndarray, period: float) -> np.ndarray:
    # Steep clipped sine: roughly square bars with a short ramp, at any (non-integer) period.
    return np.clip(0.5 + 2.0 * np.sin(2 * np.pi * t / period), 0.0, 1.0)


def _hstripes(x: np.ndarray, y: np.ndarray, r: float, rng: np.random.Generator) -> np.ndarray:
    return _stripes(y, 0.5 * r)


def _vstripes(x: np.ndarray, y: np.ndarray, r: float, rng: np.random.Generator) -> np.ndarray:
    return _stripes(x, 0.5 * r)


def _dstripes(x: np.ndarray, y: np.ndarray, r: float, rng: np.random.Generator) -> np.ndarray:
    sign = rng.choice([-1.0, 1.0])
    return _stripes((x + sign * y) / np.sqrt(2.0), 0.5 * r)


def _checker(x: np.ndarray, y: np.ndarray, r: float, rng: np.random.Generator) -> np.ndarray:
    period = 0.6 * r
    wave = np.sin(2 * np.pi * x / period) * np.sin(2 * np.pi * y / period)
    return np.clip(0.5 + 4.0 * wave, 0.0, 1.0)


def _dots(x: np.ndarray, y: np.ndarray, r: float, rng: np.random.Generator) -> np.ndarray:
    period = 0.6 * r
    dx = np.mod(x, period) - period / 2
    dy = np.mod(y, period) - period / 2
    return _soft(np.hypot(dx, dy) - 0.25 * period)


_MASKS: tuple[MaskFn, ...] = (
    _circle,
    _square,
    _triangle,
    _hstripes,
    _vstripes,
    _checker,
    _cross,
    _ring,
    _dstripes,
    _dots,
)


def _colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    # Random colours in both roles, redrawn until they differ enough for the shape to be visible:
    # colour alone must never identify a class.
    while True:
        background, foreground = rng.uniform(0, 255, size=(2, 3))
        if np.linalg.norm(foreground - background) > 120:
            return background, foreground


def render_toy_image(class_index: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Draw one size x size x 3 uint8 image of class ``CLASSES[class_index]``."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    cx, cy = rng.uniform(0.3, 0.7, size=2) * size
    radius = float(rng.uniform(0.18, 0.32) * size)
    mask = _MASKS[class_index](x - cx, y - cy, radius, rng)
    background, foreground = _colours(rng)
    pixels = background + (foreground - background) * mask[..., None]
    # A faint gradient and per-pixel noise so the background is never a flat colour.
    gradient = (x / size - 0.5) * rng.uniform(-40, 40) + (y / size - 0.5) * rng.uniform(-40, 40)
    pixels += gradient[..., None] + rng.normal(0.0, rng.uniform(4, 16), size=pixels.shape)
    return np.clip(pixels, 0, 255).round().astype(np.uint8)


def make_image_folder(
    out: str | Path, *, per_class: int = 60, size: int = 64, seed: int = 0
) -> Path:
    """Write ``per_class`` images for each of the 10 ``CLASSES`` under ``out/<class>/``.

    Files are ``<class>_<i:05d>.jpg`` (quality 90), except every 20th (``i % 20 == 0``), which is
    ``.png``. The same arguments give byte-identical files.
    """
    out = fresh_out_dir(out)
    for class_index, name in enumerate(CLASSES):
        folder = out / name
        folder.mkdir()
        for i in range(per_class):
            rng = np.random.default_rng([seed, class_index, i])
            suffix = ".png" if i % PNG_EVERY == 0 else ".jpg"
            save_image(render_toy_image(class_index, size, rng), folder / f"{name}_{i:05d}{suffix}")
    log.info("wrote %d toy images in %d classes to %s", per_class * len(CLASSES), len(CLASSES), out)
    return out
