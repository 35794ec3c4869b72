"""Pictures of samples and of statistics, drawn with PIL alone (no plotting library).

    tile(sample)        one decoded sample (ShardDataset's) as a square picture with a caption:
                        an image fitted in, a text excerpt, a point cloud from three sides
    grid(tiles, cols)   tiles side by side, rows of `cols`
    histogram(...)      a bar chart of counts, labelled, for the statistics sheet
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

TILE = 128  # pixels a side
CAPTION = 14  # pixels under each tile for its caption
INK, PAPER, MUTED = (20, 20, 20), (255, 255, 255), (120, 120, 120)


def _font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default()


def tile(sample: dict[str, Any], caption: str, size: int = TILE) -> Image.Image:
    """The sample's picture with `caption` under it."""
    if "image" in sample:
        body = _image(sample["image"], size)
    elif "points" in sample:
        body = _cloud(np.asarray(sample["points"]), size)
    else:
        body = _text(_excerpt(sample), size)
    out = Image.new("RGB", (size, size + CAPTION), PAPER)
    out.paste(body, (0, 0))
    ImageDraw.Draw(out).text((2, size + 1), _fit(caption, size), fill=INK, font=_font())
    return out


def _image(pixels: np.ndarray, size: int) -> Image.Image:
    img = Image.fromarray(np.asarray(pixels, np.uint8))
    scale = size / max(img.width, img.height)  # fitted in, small images enlarged
    how = Image.Resampling.NEAREST if scale >= 2 else Image.Resampling.BILINEAR
    img = img.resize((max(round(img.width * scale), 1), max(round(img.height * scale), 1)), how)
    out = Image.new("RGB", (size, size), PAPER)
    out.paste(img, ((size - img.width) // 2, (size - img.height) // 2))
    return out


def _cloud(points: np.ndarray, size: int) -> Image.Image:
    """Three orthographic views (x-y from above, x-z from the front, y-z from the side), each
    a third of the tile wide, the cloud scaled alike in all three."""
    canvas = np.full((size, size, 3), 255, np.uint8)
    xyz = points[:, :3].astype(np.float64) if points.ndim == 2 else np.zeros((0, 3))
    xyz = xyz[np.isfinite(xyz).all(axis=1)]
    panel = size // 3
    if len(xyz):
        lo, span = xyz.min(axis=0), max(float(np.ptp(xyz, axis=0).max()), 1e-9)
        unit = (xyz - lo) / span  # in [0, 1], aspect kept
        for n, (a, b) in enumerate(((0, 1), (0, 2), (1, 2))):
            u = (unit[:, a] * (panel - 3)).astype(int) + 1 + n * panel
            v = ((1 - unit[:, b]) * (size - 3)).astype(int) + 1
            canvas[v, u] = INK
    out = Image.fromarray(canvas)
    draw = ImageDraw.Draw(out)
    for n in (1, 2):
        draw.line([(n * panel, 0), (n * panel, size)], fill=MUTED)
    return out


def _excerpt(sample: dict[str, Any]) -> str:
    if "text" in sample:
        return str(sample["text"])
    if "tokens" in sample:
        ids = np.asarray(sample["tokens"])
        return f"{len(ids)} token ids: " + " ".join(map(str, ids[:60].tolist()))
    members = [k for k in sample if not k.startswith("__")]
    return "members: " + ", ".join(members)


def _text(text: str, size: int) -> Image.Image:
    out = Image.new("RGB", (size, size), (248, 248, 244))
    chars = max(size // 6, 8)
    lines = textwrap.wrap(" ".join(text.split()), chars)[: max(size // 12 - 1, 1)]
    ImageDraw.Draw(out).multiline_text((3, 3), "\n".join(lines), fill=INK, font=_font(),
                                       spacing=1)
    return out


def _fit(caption: str, size: int) -> str:
    chars = max(size // 6, 4)
    return caption if len(caption) <= chars else caption[: chars - 1] + "…"


def grid(tiles: Sequence[Image.Image], cols: int) -> Image.Image:
    """The tiles in rows of `cols` (the last row may be short)."""
    if not tiles:
        raise ValueError("no samples to draw")
    w, h = tiles[0].size
    rows = -(-len(tiles) // cols)
    out = Image.new("RGB", (cols * w + (cols - 1) * 2, rows * h + (rows - 1) * 2), (200, 200, 200))
    for n, t in enumerate(tiles):
        out.paste(t, ((n % cols) * (w + 2), (n // cols) * (h + 2)))
    return out


def histogram(title: str, labels: Sequence[str], counts: Sequence[int],
              size: tuple[int, int] = (420, 220)) -> Image.Image:
    """A bar chart: one bar a label, heights to the largest count, the counts written."""
    w, h = size
    out = Image.new("RGB", size, PAPER)
    draw = ImageDraw.Draw(out)
    draw.text((6, 4), title, fill=INK, font=_font())
    if not counts:
        draw.text((6, 24), "(nothing to count)", fill=MUTED, font=_font())
        return out
    top, bottom, left = 22, h - 30, 8
    width = (w - 2 * left) / len(counts)
    peak = max(max(counts), 1)
    for n, (label, count) in enumerate(zip(labels, counts, strict=True)):
        x0 = left + n * width
        y0 = bottom - (bottom - top - 12) * count / peak
        draw.rectangle([x0 + 1, y0, x0 + max(width - 2, 1), bottom], fill=(70, 110, 170))
        if width >= 18:
            draw.text((x0 + 1, y0 - 11), str(count), fill=INK, font=_font())
            draw.text((x0 + 1, bottom + 3), _fit(label, int(width)), fill=INK, font=_font())
    if width < 18:  # too many bars to name: the range below the axis
        draw.text((left, bottom + 3), f"{labels[0]} .. {labels[-1]}", fill=INK, font=_font())
    draw.line([(left, bottom), (w - left, bottom)], fill=MUTED)
    return out


def sheet(panels: Sequence[Image.Image], cols: int = 2) -> Image.Image:
    """Panels (histograms) on one page."""
    return grid(list(panels), cols)
