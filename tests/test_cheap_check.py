"""The conversion's image check decodes a JPEG at 1/8 scale (checks._decode): libjpeg still
entropy-decodes every block there, so it must refuse exactly the damaged JPEGs a full decode
refuses. Checked over 660 damaged copies of real-looking photos (baseline, progressive, grey):
cut at 40 points, 1 to 256 bytes overwritten, 500-byte runs zeroed.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from shardflow.builtin.photos import render_photo
from shardflow.errors import DataError
from shardflow.samples import checks


def photos() -> list[bytes]:
    out = []
    for k in range(6):
        data = render_photo(np.random.default_rng(k), hue=k / 6)
        img = Image.open(io.BytesIO(data))
        if k % 2 or k == 4:  # progressive; grey
            buf = io.BytesIO()
            (img.convert("L") if k == 4 else img).save(buf, "JPEG", quality=90,
                                                       progressive=bool(k % 2))
            data = buf.getvalue()
        out.append(data)
    return out


def damaged(data: bytes) -> list[bytes]:
    rng = np.random.default_rng(len(data))
    found = [data[:int(len(data) * f)] for f in np.linspace(0.05, 0.999, 40)]
    for n in (1, 4, 32, 256):
        for _ in range(15):
            copy = bytearray(data)
            for at in rng.integers(600, len(data) - 2, n):
                copy[at] = int(rng.integers(0, 256))
            found.append(bytes(copy))
    for _ in range(10):
        copy, at = bytearray(data), int(rng.integers(600, len(data) - 1000))
        copy[at:at + 500] = bytes(500)
        found.append(bytes(copy))
    return found


def full_decode_fails(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
        return False
    except (OSError, ValueError, SyntaxError):
        return True


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_scaled_check_refuses_what_a_full_decode_refuses():
    limits, refused, total = checks.CheckLimits(), 0, 0
    for data in photos():
        assert checks.check_image(data, limits) == "JPEG"
        for copy in damaged(data):
            total += 1
            try:
                checks.check_image(copy, limits)
                reason = None
            except DataError as err:
                reason = err.reason
                refused += 1
            # passed: a full decode passes too; refused as undecodable: a full decode fails
            # (a structure refusal, bad-jpeg-structure, is the header rule's, not the decode's)
            if reason is None or reason == "bad-image":
                assert (reason == "bad-image") == full_decode_fails(copy), (len(copy), reason)
    assert total == 660 and refused >= 300  # the corpus does damage: about half fail
