"""Images made smaller at conversion: make_shards' `--max-side N --jpeg-quality Q`.

FFCV's most used option (`max_resolution` + `jpeg_quality`): ImageNet stored at 256 px is a
fraction of its bytes, and every epoch then decodes that much less. An image whose longer side
is above N is turned upright by its EXIF orientation, read as the loaders read it (headers.py:
an orientation only in XMP turns nothing here either; the tag is then dropped, so nothing turns
it twice), resized so that its longer side is N (PIL's antialiased Lanczos, from a JPEG drafted
at the largest DCT scale that still gives at least N), and stored as JPEG at quality Q: grey
stays grey, an image with transparency or 16 bits becomes PNG instead. An image within N keeps
its bytes, unless `reencode_all` (then it is re-encoded as above, at its size). A sample whose
images must stay aligned (a mask beside its image) is left alone by checks.repair_sample.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from shardflow.samples import headers

RESIZED = "resized"  # counted in the manifest's `reencoded`, as the repairs are
REENCODED = "reencoded-at-quality"
KEPT_FOR_MASK = "kept-for-its-mask"  # left as it is: its mask would no longer fit it
# What --max-side did, as counted in the manifest's `reencoded` beside the repairs
OUTCOMES = (RESIZED, REENCODED, KEPT_FOR_MASK)
# PIL's modes of 16- and 32-bit grey: stored as I;16 (gray16)
GRAY16_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


@dataclass(frozen=True)
class Downsize:
    """What `--max-side`, `--jpeg-quality` and `--reencode-all` ask for."""

    max_side: int
    jpeg_quality: int = 90
    reencode_all: bool = False

    def __post_init__(self) -> None:
        if self.max_side < 1:
            raise ValueError(f"max_side={self.max_side}: must be at least 1")
        if not 1 <= self.jpeg_quality <= 100:
            raise ValueError(f"jpeg_quality={self.jpeg_quality}: must be in 1..100")

    def acts_on(self, size: tuple[int, int]) -> bool:
        """Whether an image of `size` is re-encoded (resized, or all are re-encoded)."""
        return max(size) > self.max_side or self.reencode_all


def downsized(data: bytes, how: Downsize) -> tuple[bytes, str, str] | None:
    """(bytes, extension, the repair's name) of the image made smaller or re-encoded, or None
    where it keeps its bytes (within max_side, and reencode_all off)."""
    with Image.open(io.BytesIO(data)) as img:
        if not how.acts_on(img.size):
            return None
        orientation = _orientation(data, str(img.format))
        # The size decides, before a draft has scaled a JPEG down (to max_side, maybe)
        size = img.size[::-1] if headers.ORIENTATIONS[orientation][0] else img.size
        resized = max(size) > how.max_side
        if img.format == "JPEG":  # decode at 1/2..1/8 scale where that still gives max_side
            img.draft(img.mode, (how.max_side, how.max_side))
        upright = turned(img, orientation)
    if upright.mode in GRAY16_MODES:
        upright = gray16(upright)
    if resized:
        scale = how.max_side / max(size)
        upright = upright.resize((max(1, round(size[0] * scale)), max(1, round(size[1] * scale))),
                                 Image.Resampling.LANCZOS)
    return _encoded(upright, how) + (RESIZED if resized else REENCODED,)


def _orientation(data: bytes, fmt: str) -> int:
    """The EXIF orientation the loaders turn the image by: the header parser's (headers.py),
    not Pillow's exif_transpose, which also reads XMP and PNG text chunks the loaders never
    do. 1 for a TIFF: PIL's TIFF plugin turns its pixels upright as it loads them."""
    return 1 if fmt == "TIFF" else headers.read_header(data).orientation


def turned(img: Image.Image, orientation: int) -> Image.Image:
    """The stored pixels turned upright by an EXIF orientation, as the loaders turn them
    (headers.ORIENTATIONS: transpose, then the flips); a new image, without EXIF."""
    transpose, hflip, vflip = headers.ORIENTATIONS[orientation]
    img.load()
    out = img.copy() if orientation == 1 else img
    for on, how in ((transpose, Image.Transpose.TRANSPOSE),
                    (hflip, Image.Transpose.FLIP_LEFT_RIGHT),
                    (vflip, Image.Transpose.FLIP_TOP_BOTTOM)):
        if on:
            out = out.transpose(how)
    out.info.pop("exif", None)  # its orientation is applied: nothing may turn it again
    return out


def gray16(img: Image.Image) -> Image.Image:
    """A 16- or 32-bit grey image as I;16, clipped to 0..65535: the samples the loaders read
    and scale to 8 bits by their high byte (image/portable.py `_rgb`, DALI likewise), kept
    at 16 bits. Through numpy: PIL's convert("I;16") of I;16B clips to 255, and its
    convert("RGB") of any of them clips to 255 (a white image)."""
    return Image.fromarray(np.asarray(img).clip(0, 65535).astype(np.uint16))


def _encoded(img: Image.Image, how: Downsize) -> tuple[bytes, str]:
    """JPEG at how.jpeg_quality (grey stays grey), or PNG for transparency and 16 bits."""
    out = io.BytesIO()
    if img.mode in ("RGBA", "LA", "I;16") or "transparency" in img.info:
        img.save(out, format="PNG")
        return out.getvalue(), "png"
    img.convert("L" if img.mode in ("L", "1") else "RGB").save(
        out, format="JPEG", quality=how.jpeg_quality)
    return out.getvalue(), "jpg"
