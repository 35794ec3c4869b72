"""Photo-like JPEG corpus for loader benchmarks.

Flat synthetic shapes decode several times faster than real photos and flatter every loader, so
the benchmark corpus imitates ImageNet's statistics instead (see shared BENCHMARKS.md): 350-500 px
on the long side, aspect 3:4 to 4:3, 40-110 KB at JPEG quality 90. Content is a colour gradient,
multi-octave value noise, soft-edged blobs and fine grain. The grain's strength is tuned per
image, by re-encoding, so that the file lands on a size drawn for it: JPEG size follows
high-frequency energy, and the pixel count varies by almost the same factor as the allowed bytes.
The layout matches ``make_image_folder``: ``out/<class>/<class>_<i:05d>.jpg``.

``make_large_photos`` writes the photos people take today instead (phones, OpenImages and
CC12M originals): 3000-4000 px on the long side, about 1 MB each (0.6-1.6 MB) at quality 90,
with or without restart markers (cameras' encoders write them; libjpeg's, by default, not).
Their content is rendered at a quarter of the size and enlarged (a photo's detail is mostly
coarser than its pixels), then grain at full size is tuned to the drawn file size.
"""

from __future__ import annotations

import colorsys
import io
import logging
from pathlib import Path

import numpy as np
from PIL import Image

from .images import JPEG_QUALITY, fresh_out_dir

log = logging.getLogger(__name__)

LONG_SIDE = (350, 500)
MIN_BYTES, MAX_BYTES = 40_000, 110_000
# Targets are drawn inside a narrower band so the tuning loop has room to miss.
_TARGET_BYTES = (48_000, 100_000)
_TARGET_BYTES_PER_PIXEL = (0.3, 0.55)
_MAX_ENCODES = 4
# JPEG bytes per pixel at quality 90 against grain strength, measured on this generator's
# content. Only a first guess: each encode corrects it for the image at hand.
_GRAIN_STRENGTH = np.array([0.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0])
_BYTES_PER_PIXEL = np.array([0.17, 0.22, 0.31, 0.39, 0.46, 0.57, 0.67])


def _shape(rng: np.random.Generator) -> tuple[int, int]:
    long_side = int(rng.integers(LONG_SIDE[0], LONG_SIDE[1] + 1))
    short_side = int(round(long_side * rng.uniform(0.75, 1.0)))
    return (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)


LARGE_LONG_SIDE = (3000, 4000)
LARGE_BYTES = (600_000, 1_600_000)
_LARGE_TARGET_BYTES = (800_000, 1_300_000)


def _upsampled_noise(rng: np.random.Generator, height: int, width: int, cells: int) -> np.ndarray:
    # Value noise: a coarse random grid, bicubic-resized to full size (PIL does this in C).
    grid_h = max(2, round(cells * height / max(height, width))) + 1
    grid_w = max(2, round(cells * width / max(height, width))) + 1
    grid = rng.standard_normal((grid_h, grid_w), dtype=np.float32)
    return np.asarray(Image.fromarray(grid, "F").resize((width, height), Image.Resampling.BICUBIC))


def _fractal(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    # Octaves from a few cells across up to ~2 px features; persistence sets the "roughness".
    persistence = rng.uniform(0.55, 0.75)
    total = np.zeros((height, width), np.float32)
    for octave, cells in enumerate((3, 6, 12, 24, 48, 96, 192)):
        total += persistence**octave * _upsampled_noise(rng, height, width, cells)
    return total


def _palette(rng: np.random.Generator, hue: float, count: int) -> np.ndarray:
    # Colours near the class hue, so classes differ in tint as real categories often do.
    hues = (hue + rng.normal(0, 0.08, count)) % 1.0
    saturations, values = rng.uniform(0.2, 0.8, count), rng.uniform(0.3, 0.95, count)
    colours = [colorsys.hsv_to_rgb(*hsv) for hsv in zip(hues, saturations, values, strict=True)]
    return np.asarray(colours, np.float32) * 255


def _blobs(rng: np.random.Generator, canvas: np.ndarray, colours: np.ndarray) -> None:
    # Soft-edged ellipses give the large-scale edges that noise alone lacks. Each is drawn only
    # inside its bounding box, which is most of the generator's time saved.
    height, width, _ = canvas.shape
    for colour in colours:
        cy, cx = float(rng.uniform(0, height)), float(rng.uniform(0, width))
        ry, rx = (float(v) for v in rng.uniform(0.05, 0.3, size=2) * max(height, width))
        top, bottom = max(0, int(cy - ry)), min(height, int(cy + ry) + 1)
        left, right = max(0, int(cx - rx)), min(width, int(cx + rx) + 1)
        y = (np.arange(top, bottom, dtype=np.float32)[:, None] - cy) / ry
        x = (np.arange(left, right, dtype=np.float32)[None, :] - cx) / rx
        edge, opacity = rng.uniform(3, 30), rng.uniform(0.4, 0.9)
        alpha = np.clip((1.0 - np.sqrt(y * y + x * x)) * edge, 0, 1) * opacity
        patch = canvas[top:bottom, left:right]
        patch += alpha[..., None] * (colour - patch)


def _base(rng: np.random.Generator, hue: float) -> np.ndarray:
    """Grain-free float32 HxWx3 content in roughly 0..255."""
    height, width = _shape(rng)
    return _base_of(rng, hue, height, width)


def _base_of(rng: np.random.Generator, hue: float, height: int, width: int) -> np.ndarray:
    start, end, *blob_colours = _palette(rng, hue, int(rng.integers(4, 9)))
    angle = rng.uniform(0, 2 * np.pi)
    y = np.arange(height, dtype=np.float32)[:, None] / height
    x = np.arange(width, dtype=np.float32)[None, :] / width
    ramp = (np.cos(angle) * x + np.sin(angle) * y + 1.0) / 2.0
    canvas = start + (end - start) * ramp[..., None]
    _blobs(rng, canvas, np.asarray(blob_colours))
    canvas *= (1.0 + 0.25 * _fractal(rng, height, width))[..., None]
    for channel in range(3):
        canvas[..., channel] += 12.0 * _upsampled_noise(rng, height, width, 4)
    return canvas


def _encode(pixels: np.ndarray, restart_rows: int = 0) -> bytes:
    buffer = io.BytesIO()
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY, restart_marker_rows=restart_rows)
    return buffer.getvalue()


def render_photo(rng: np.random.Generator, hue: float) -> bytes:
    """Return the JPEG bytes of one photo-like image, sized to a target drawn from ``rng``."""
    base = _base(rng, hue)
    grain = rng.standard_normal(base.shape, dtype=np.float32)
    pixels = base.shape[0] * base.shape[1]
    # Real photos grow with their pixel count; clip so every size stays inside the allowed band.
    target = float(np.clip(pixels * rng.uniform(*_TARGET_BYTES_PER_PIXEL), *_TARGET_BYTES))
    offset = 0.0
    for _ in range(_MAX_ENCODES):
        strength = np.interp(target / pixels - offset, _BYTES_PER_PIXEL, _GRAIN_STRENGTH)
        data = _encode(base + np.float32(strength) * grain)
        if abs(len(data) - target) < 0.1 * target:
            break
        # This image's content compresses better or worse than the table's average.
        offset = len(data) / pixels - np.interp(strength, _GRAIN_STRENGTH, _BYTES_PER_PIXEL)
    if not MIN_BYTES <= len(data) <= MAX_BYTES:
        log.warning("photo of %d bytes is outside %d..%d", len(data), MIN_BYTES, MAX_BYTES)
    return data


def make_photo_corpus(
    out: str | Path, *, count: int = 200, classes: int = 10, seed: int = 0
) -> Path:
    """Write ``count`` photo-like JPEGs, dealt round-robin into ``classes`` class folders.

    Folders are ``class_<c:03d>``; image ``k`` goes to class ``k % classes`` as its
    ``k // classes``-th file. The same arguments give byte-identical files.
    """
    out = fresh_out_dir(out)
    names = [f"class_{c:03d}" for c in range(classes)]
    for name in names:
        (out / name).mkdir()
    total = 0
    for k in range(count):
        class_index, i = k % classes, k // classes
        rng = np.random.default_rng([seed, class_index, i])
        data = render_photo(rng, hue=class_index / classes)
        (out / names[class_index] / f"{names[class_index]}_{i:05d}.jpg").write_bytes(data)
        total += len(data)
    mean_kb = total / max(count, 1) / 1e3
    log.info("wrote %d photo-like JPEGs (%.1f KB mean) to %s", count, mean_kb, out)
    return out


def render_large_photo(rng: np.random.Generator, hue: float, restart_rows: int = 0) -> bytes:
    """The JPEG bytes of one large photo-like image (see the module docstring), with a
    restart marker every `restart_rows` MCU rows (0: none)."""
    long_side = int(rng.integers(LARGE_LONG_SIDE[0], LARGE_LONG_SIDE[1] + 1))
    short_side = int(round(long_side * rng.uniform(0.75, 1.0)))
    height, width = (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)
    small = _base_of(rng, hue, height // 4, width // 4)
    base = np.asarray(Image.fromarray(np.clip(small, 0, 255).astype(np.uint8), "RGB").resize(
        (width, height), Image.Resampling.BICUBIC), dtype=np.float32)
    grain = rng.standard_normal((height, width, 1), dtype=np.float32)  # luminance grain
    target = float(rng.uniform(*_LARGE_TARGET_BYTES))
    low, high, data = 0.0, 16.0, b""
    for _ in range(_MAX_ENCODES + 2):  # bisect the grain's strength on the file size
        strength = (low + high) / 2
        data = _encode(base + np.float32(strength) * grain, restart_rows)
        if abs(len(data) - target) < 0.1 * target:
            break
        low, high = (strength, high) if len(data) < target else (low, strength)
    if not LARGE_BYTES[0] <= len(data) <= LARGE_BYTES[1]:
        log.warning("large photo of %d bytes is outside %d..%d", len(data), *LARGE_BYTES)
    return data


def make_large_photos(out: str | Path, *, count: int = 60, classes: int = 10, seed: int = 0,
                      restart_rows: int = 0) -> Path:
    """``count`` large photo-like JPEGs (render_large_photo), laid out as make_photo_corpus
    lays out its own; the same arguments give byte-identical files. `restart_rows` 1 writes
    them as phones' and cameras' hardware encoders commonly do: a restart marker every MCU
    row (image/restarts.py decodes such a photo from the marker above a crop)."""
    out = fresh_out_dir(out)
    names = [f"class_{c:03d}" for c in range(classes)]
    for name in names:
        (out / name).mkdir()
    for k in range(count):
        class_index, i = k % classes, k // classes
        rng = np.random.default_rng([seed, class_index, i, 4000])
        data = render_large_photo(rng, hue=class_index / classes, restart_rows=restart_rows)
        (out / names[class_index] / f"{names[class_index]}_{i:05d}.jpg").write_bytes(data)
    log.info("wrote %d large photo-like JPEGs to %s", count, out)
    return out
