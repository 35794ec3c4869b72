"""A JPEG cut at a restart marker: the rows above a window are not decoded at all.

libjpeg decodes a scan from its first byte, so reaching row 3000 of a photo means
Huffman-decoding every block above it. rows.py stops at the window's last row; DALI's window
decode skips the inverse DCT of the rows above, not their entropy decoding. A restart marker
(RSTn, written every `DRI` MCUs) resets the decoder's state, so a scan can also begin right
after one. Cameras' and phones' hardware encoders commonly write them (for parallel decoding);
libjpeg, and PIL through it, only when asked (`restart_marker_rows`).

    the header (jpegscan.scan): a baseline or extended Huffman frame, one scan holding every
    component, a restart interval
    -> the MCU rows where an interval starts at the left edge and follows an RST7 (the next
       marker the decoder then meets is RST0, the one it expects after a scan header)
    -> the latest such row at least one MCU row above the first row the window reads
       (the margin covers the chroma upsampling, which reads the row above)
    -> the header up to the scan, the frame's height made the rows that are left, then the
       scan after that marker: a JPEG of the photo's lower part, whose rows are the very rows
       of a full decode (tests/test_restarts.py)

Every restart marker above the cut is found and its number checked before anything is cut:
a scan whose markers there are missing, extra or out of order, or which holds another marker
there (damage), is decoded whole, as before. Below the cut, the decoder then meets the very
bytes a full decode meets, in the same state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardflow.samples import jpegscan
from shardflow.samples.headers import scan_start

DRI = 0xDD
HUFFMAN_SEQUENTIAL = (0xC0, 0xC1)  # baseline, extended: one scan per component set
RST0 = 0xD0


@dataclass(frozen=True)
class Layout:
    """What a cut needs to know of a JPEG with restart markers."""

    height_at: int  # offset of the frame header's height field
    height: int
    mcu_height: int  # pixel rows of one MCU row
    mcus_per_row: int
    interval: int  # MCUs between restart markers
    scan_data: int  # offset of the scan's first entropy-coded byte

    def intervals(self) -> int:
        mcu_rows = math.ceil(self.height / self.mcu_height)
        return math.ceil(mcu_rows * self.mcus_per_row / self.interval)


@dataclass(frozen=True)
class Cut:
    data: bytes  # the JPEG of rows `top` to the last
    top: int  # the first row it holds, in the original's rows


def cut_above(data: bytes, first_row: int) -> Cut | None:
    """A JPEG of `data`'s rows from a restart marker at least one MCU row above `first_row`
    to the last; None when no marker is there (or `data` has none, or is not a JPEG whose
    restart markers this cut understands)."""
    scan = scan_start(data)
    if scan is None or data.find(b"\xff\xdd", 2, scan) < 0:  # no DRI: most files, at once
        return None
    found = layout(data)
    if found is None:
        return None
    row = start_row(found, first_row // found.mcu_height - 1)
    if row is None:
        return None
    marker = restart_marker(data, found, row * found.mcus_per_row // found.interval - 1)
    if marker is None:
        return None
    after = marker + 2  # the marker before that interval, an RST7
    rows_left = found.height - row * found.mcu_height
    header = bytearray(data[:found.scan_data])
    header[found.height_at: found.height_at + 2] = rows_left.to_bytes(2, "big")
    return Cut(bytes(header) + data[after:], row * found.mcu_height)


def layout(data: bytes) -> Layout | None:
    """The frame, restart interval and scan of a JPEG; None unless it is a Huffman
    sequential JPEG whose first scan holds every component and has restart markers."""
    try:
        found = jpegscan.scan(data)
    except jpegscan.JpegStructureError:
        return None
    frames = [s for s in found.segments if s.marker in jpegscan.SOF]
    restarts = [s for s in found.segments if s.marker == DRI]
    if not restarts or len(frames) != 1 or frames[0].marker not in HUFFMAN_SEQUENTIAL:
        return None
    dri, sof = restarts[-1], frames[0]  # libjpeg keeps the last DRI read before the scan
    interval = int.from_bytes(data[dri.start + 4: dri.start + 6], "big")
    body = data[sof.start + 4: sof.end]  # precision, height, width, components, 3 bytes each
    height, width, count = int.from_bytes(body[1:3], "big"), int.from_bytes(body[3:5], "big"), \
        body[5]
    sos = found.scan_start
    scan_data = sos + 2 + int.from_bytes(data[sos + 2: sos + 4], "big")
    if scan_data >= len(data) or not interval or dri.end - dri.start != 6 or \
            len(body) < 6 + 3 * count or data[sos + 4] != count:
        return None
    factors = [(body[7 + 3 * i] >> 4, body[7 + 3 * i] & 15) for i in range(count)]
    if not all(1 <= h <= 4 and 1 <= v <= 4 for h, v in factors):
        return None
    # One component: the MCU is one 8x8 block whatever its sampling factors.
    mcu_w = 8 * max(h for h, _ in factors) if count > 1 else 8
    mcu_h = 8 * max(v for _, v in factors) if count > 1 else 8
    return Layout(sof.start + 5, height, mcu_h, math.ceil(width / mcu_w), interval, scan_data)


def start_row(found: Layout, below: int) -> int | None:
    """The latest MCU row, at `below` or above it but not the first, where an interval
    starts at the left edge after an RST7 marker; None when there is none."""
    for row in range(min(below, math.ceil(found.height / found.mcu_height) - 1), 0, -1):
        mcus = row * found.mcus_per_row
        if mcus % found.interval == 0 and (mcus // found.interval) % 8 == 0:
            return row
    return None


def restart_marker(data: bytes, found: Layout, index: int) -> int | None:
    """The offset of the scan's restart marker `index` (from 0), or None unless every marker
    before it is there, numbered RST0, RST1, ..., RST7, RST0... in order, and no other marker
    comes before it (damage: libjpeg, meeting one where it expects a restart, leaves the rest
    of the scan empty, which the cut would not). Only the bytes up to it are searched: first
    as far as its share of the intervals, and a quarter more."""
    share = (index + 1) / found.intervals()
    guess = found.scan_data + int((len(data) - found.scan_data) * share * 1.25) + 4096
    for stop in (min(guess, len(data)), len(data)):
        markers, other = _markers(data, found.scan_data, stop)
        if len(markers) > index:
            break
    else:
        return None
    numbers = np.frombuffer(data, np.uint8)[markers[: index + 1] + 1] - RST0
    if other <= markers[index] or not np.array_equal(numbers, np.arange(index + 1) % 8):
        return None
    return int(markers[index])


def _markers(data: bytes, start: int, stop: int) -> tuple[np.ndarray, int]:
    """Offsets of the restart markers (0xFF, then 0xD0-0xD7) in data[start:stop], and of the
    first other marker there (`stop` if none): in a whole scan, a 0xFF is followed by 0x00
    (a stuffed byte), another 0xFF (fill) or a restart marker."""
    scan = np.frombuffer(data, np.uint8, stop - start, start)
    ff, after = scan[:-1] == 0xFF, scan[1:]
    restart = ff & ((after & 0xF8) == RST0)
    other = ff & (after != 0) & (after != 0xFF) & ~restart
    first = int(np.argmax(other)) if other.any() else stop - start
    return np.flatnonzero(restart) + start, first + start
