"""A JPEG's header as the loaders read it, and the lossless repair of what they refuse in it.

Between the start-of-image marker and the first start-of-scan, DALI's JPEG parser
(nvImageCodec) and the image loader's header parser (pipeline/image/augment.py) expect marker
segments back to back: 0xFF, a marker byte, a length, the payload. libjpeg, which PIL decodes
with, skips anything else there with a warning ("extraneous bytes before marker"). So a file
with such bytes (a stuffed 0xFF00 after the header, the tail of an APP14 segment whose length
field is too short, a restart marker before the scan) decodes in PIL and fails in the loader:
DALI says "Invalid marker", the header parser "JPEG header has no frame size".

`scan` walks the header the way libjpeg does and lists what the strict readers would refuse;
`rebuild` writes the segments libjpeg read back to back, so the pixels do not change: the
entropy-coded data from the first scan header on is copied as is.
"""

from __future__ import annotations

from dataclasses import dataclass

SOI = b"\xff\xd8"
# Start-of-frame markers: 0xC0-0xCF except DHT (C4), JPG (C8) and DAC (CC), as both readers.
SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length. DALI's parser reads a length after every marker but SOS, so one
# of these before the scan derails it.
STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
SOS, EOI = 0xDA, 0xD9
# Payloads shorter than these are ignored by libjpeg (not JFIF / Adobe data to it) and make
# PIL's header parser fail ("cannot identify image file"): dropping them changes nothing libjpeg
# or DALI reads.
SHORT_APP = {0xE0: (b"JFIF", 14), 0xEE: (b"Adobe", 12)}


class JpegStructureError(ValueError):
    """A header that no rebuilding makes readable (libjpeg itself would refuse most)."""


@dataclass(frozen=True)
class Segment:
    marker: int
    start: int  # offset of the 0xFF right before the marker byte
    end: int  # offset just past the payload

    def short_app(self, data: bytes) -> bool:
        prefix, length = SHORT_APP.get(self.marker, (b"", 0))
        payload = data[self.start + 4: self.end]
        return bool(prefix) and payload.startswith(prefix) and len(payload) < length


@dataclass(frozen=True)
class JpegScan:
    """The marker segments before the first scan and what the strict readers refuse."""

    segments: tuple[Segment, ...]
    scan_start: int  # offset of the first start-of-scan marker (its 0xFF)
    problems: tuple[str, ...]  # empty: DALI and the header parser read this header
    short_app: bool  # holds an APP segment PIL's parser fails on (see SHORT_APP)


def readable(data: bytes) -> bytes:
    """`data` as the loaders decode it: a JPEG whose header holds what libjpeg skips (and
    DALI or PIL's parser refuses) rebuilt losslessly, as `convert shards` writes it, so
    that every backend, verify and ShardDataset read the same pixels. Anything else, and a
    header no rebuild makes readable (whose own checks then name it), as it is."""
    if data[:2] != SOI or _back_to_back(data):
        return data
    try:
        found = scan(data)
        if not found.problems and not found.short_app:
            return data
        fixed = rebuild(data, found)
        return fixed if not scan(fixed).problems else data
    except JpegStructureError:
        return data


def _back_to_back(data: bytes) -> bool:
    """Whether the header's segments lie back to back up to the first scan, with no short
    APP segment: the few-microsecond test that spares nearly every photo `scan`."""
    i, n = 2, len(data)
    while i + 4 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == SOS:
            return True
        if marker in STANDALONE or marker == 0x00:
            return False
        end = i + 2 + int.from_bytes(data[i + 2: i + 4], "big")
        prefix, length = SHORT_APP.get(marker, (b"", 0))
        if prefix and data[i + 4: end].startswith(prefix) and end - i - 4 < length:
            return False
        i = end
    return False


def scan(data: bytes) -> JpegScan:
    """Walk the header from the start-of-image marker to the first start-of-scan, skipping
    what libjpeg skips. JpegStructureError when the header cannot be read at all."""
    if data[:2] != SOI:
        raise JpegStructureError("no start-of-image marker (FFD8) at byte 0")
    segments: list[Segment] = []
    problems: list[str] = []
    pos, frame = 2, False
    while True:
        first_ff, at = _next_marker(data, pos)
        if first_ff > pos:
            problems.append(f"{first_ff - pos} bytes that are not a marker segment at offset "
                            f"{pos}, before the scan (DALI: 'Invalid marker')")
        marker = data[at]
        if marker == SOS:
            if not frame:
                raise JpegStructureError("a scan before any frame header (no SOF marker)")
            return JpegScan(tuple(segments), at - 1, tuple(problems),
                            any(s.short_app(data) for s in segments))
        if marker in STANDALONE:
            problems.append(f"marker FF{marker:02X} without a length at offset {at - 1}, "
                            "before the scan (DALI reads a length after it)")
            pos = at + 1
            continue
        segment = _segment(data, at)
        if segment.marker in SOF:
            if frame:
                raise JpegStructureError(f"a second frame header (FF{marker:02X}) at offset "
                                         f"{segment.start}")
            _check_frame(data, segment)
            frame = True
        segments.append(segment)
        pos = segment.end


def _next_marker(data: bytes, pos: int) -> tuple[int, int]:
    """(offset of the first 0xFF of the next marker, offset of its marker byte), skipping
    non-0xFF bytes and stuffed 0xFF00 pairs as libjpeg's next_marker does; 0xFF fill bytes
    before a marker are allowed by every reader."""
    while True:
        first = data.find(b"\xff", pos)
        if first < 0:
            raise JpegStructureError("no start-of-scan marker: the header is cut short")
        at = first
        while at < len(data) and data[at] == 0xFF:
            at += 1
        if at >= len(data):
            raise JpegStructureError("no start-of-scan marker: the header is cut short")
        if data[at] != 0x00:
            return first, at
        pos = at + 1  # FF00 is not a marker: libjpeg discards it, DALI refuses it


def _segment(data: bytes, at: int) -> Segment:
    marker = data[at]
    if marker in (0xD8, EOI):
        what = "second start-of-image" if marker == 0xD8 else "end-of-image"
        raise JpegStructureError(f"a {what} marker at offset {at - 1}, before any scan")
    if at + 3 > len(data):
        raise JpegStructureError(f"marker FF{marker:02X} at offset {at - 1} is cut short")
    length = int.from_bytes(data[at + 1: at + 3], "big")
    end = at + 1 + length
    if length < 2 or end > len(data):
        raise JpegStructureError(f"segment FF{marker:02X} at offset {at - 1} declares "
                                 f"{length} bytes; {len(data) - at - 1} are left")
    return Segment(marker, at - 1, end)


def _check_frame(data: bytes, sof: Segment) -> None:
    """What DALI's parser needs of the frame header: a size and 1, 3 or 4 components."""
    body = data[sof.start + 4: sof.end]
    if len(body) < 6:
        raise JpegStructureError(f"frame header at offset {sof.start} is {len(body)} bytes")
    height, width = int.from_bytes(body[1:3], "big"), int.from_bytes(body[3:5], "big")
    if not width or not height:
        raise JpegStructureError(f"frame header declares a {width}x{height} image (a size "
                                 "given later by a DNL marker is not supported)")
    if body[5] not in (1, 3, 4):
        raise JpegStructureError(f"frame header declares {body[5]} components; the loaders "
                                 "decode 1 (gray), 3 (YCbCr/RGB) or 4 (CMYK/YCCK)")


def rebuild(data: bytes, found: JpegScan) -> bytes:
    """The header's segments back to back (without what libjpeg skipped, fill bytes and the
    short APP segments libjpeg ignores), then everything from the first scan on."""
    kept = [data[s.start: s.end] for s in found.segments if not s.short_app(data)]
    return SOI + b"".join(kept) + data[found.scan_start:]
