"""A JPEG decoded down to a row, not below: the portable backend's window needs the rows
above its bottom edge only (libjpeg decodes from the top), and a random crop of a photo ends,
on average, well above the photo's last row.

    Image.open (header only; `draft` may have set a DCT scale) -> the image made `rows` tall
    -> the last row filled with a sentinel -> PIL's own JPEG decoder, fed the whole file,
       stops after `rows` rows -> libjpeg then refuses to finish a decompression that left
       rows unread (an error PIL reports) -> the sentinel row overwritten: every row decoded,
       the very pixels a full decode gives (tests/test_portable.py); still there: the data
       ended or broke above it, and the caller decodes the whole image as before, which
       raises as before

A file cut short (no end-of-image marker after its scan) is never cut: it is decoded whole,
and refused, as before. What a cut can miss is damage below the window that libjpeg treats
as fatal (most damage it only warns about, in either decode): the window's pixels are whole
all the same.

Only PIL's private decoder entry (`Image._getdecoder`, stable since Pillow 2) is used beyond
the public API, and only on a JPEG of one tile; anything else is left to `load()`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image, ImageFile

from shardflow.samples.headers import whole_jpeg

SENTINEL = (13, 247, 61, 7)  # a row of this colour is left by no photo, and if one were,
# the caller's full decode would give the same pixels: the sentinel costs time, never pixels


def resized_rows(box: tuple[float, float, float, float], size: int, height: int) -> int:
    """The rows PIL's bilinear resize of `box` to `size` reads: to the box's bottom and a
    filter's reach past it (support 1 scaled by the reduction), within the image."""
    reach = (box[3] - box[1]) / size + 1.0
    return min(height, math.ceil(box[3] + reach) + 1)


def load_rows(img: Image.Image, rows: int, data: Any) -> bool | None:
    """Decode the first `rows` rows of `img` (opened from `data`, not loaded) into it: True
    when done; None when the cut does not apply (not a one-tile JPEG, or every row is
    needed), `img` untouched; False when the rows did not all come, `img` spoiled (open the
    data again and load it whole)."""
    if not isinstance(img, ImageFile.ImageFile) or img.format not in ("JPEG", "MPO") or \
            rows >= img.height or rows < 1 or \
            len(img.tile) != 1 or img.tile[0][0] != "jpeg":
        return None
    codec, extents, offset, args = img.tile[0]
    width = img.width
    raw = data if isinstance(data, bytes) else bytes(data)
    # A file cut short (headers.whole_jpeg) is left to the full decode, which says it is
    # truncated.
    whole = extents is not None and tuple(extents) == (0, 0, width, img.height)
    if not whole or not whole_jpeg(raw, offset):
        return None
    img._size = (width, rows)
    img.load_prepare()
    bands = len(img.getbands())
    img.im.paste(SENTINEL[:bands] if bands > 1 else SENTINEL[0], (0, rows - 1, width, rows))
    decoder = Image._getdecoder(img.mode, codec, args, img.decoderconfig)
    try:
        decoder.setimage(img.im, (0, 0, width, rows))
        decoder.decode(memoryview(raw)[offset:])  # stops after the last row (see above)
    finally:
        decoder.cleanup()
    img.tile = []  # loaded: load() and crop() use these pixels
    last = np.asarray(img.crop((0, rows - 1, width, rows)))
    return not (last == np.asarray(SENTINEL[:bands] if bands > 1 else SENTINEL[0])).all()

