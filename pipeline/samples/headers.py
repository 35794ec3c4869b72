"""Image headers: the size as stored and the EXIF orientation, read from the first bytes of
JPEG, PNG, WebP, BMP and TIFF files, before anything is decoded (the pixel limit is checked
here, and the crop window drawn from the size).

    JPEG  the frame header (SOFn) and the first EXIF APP1 segment
    PNG   IHDR and the eXIf chunk (before or after the image data, as PIL reads it)
    WebP  the VP8 / VP8L bitstream header or the VP8X canvas, and the EXIF chunk; an
          animated WebP is refused (the loaders decode still images)
    BMP   the DIB header (a negative height: stored top-down); BMP has no orientation
    TIFF  ImageWidth, ImageLength and Orientation of the first IFD

The orientation is what PIL's ImageOps.exif_transpose applies to each of them from EXIF;
DALI's own is left off, so that one parser decides for every backend. An orientation written
only in XMP (tiff:Orientation) or in a PNG's "Raw profile type exif" text chunk, which
Pillow's exif_transpose also reads, is not read here: neither backend turns such an image.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

from shardflow.errors import DataError

# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic...)
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_STANDALONE = {0x01, *range(0xD0, 0xD9)}
_PNG = b"\x89PNG\r\n\x1a\n"


# EXIF orientation -> (transpose, horizontal flip, vertical flip) that, applied to the stored
# pixels in that order, give the upright image: PIL's ImageOps.exif_transpose, tag by tag
# (5 TRANSPOSE, 6 ROTATE_270, 7 TRANSVERSE, 8 ROTATE_90).
ORIENTATIONS = {1: (False, False, False), 2: (False, True, False), 3: (False, True, True),
                4: (False, False, True), 5: (True, False, False), 6: (True, True, False),
                7: (True, True, True), 8: (True, False, True)}
_ORIENTATION_TAG = 0x0112


@dataclass(frozen=True)
class ImageHeader:
    """An image's size as stored and its EXIF orientation (1: upright, or no tag)."""

    width: int
    height: int
    orientation: int = 1

    def upright_size(self) -> tuple[int, int]:
        """(width, height) once turned upright: swapped by the orientations that transpose."""
        transpose = ORIENTATIONS[self.orientation][0]
        return (self.height, self.width) if transpose else (self.width, self.height)


def read_header(data: bytes) -> ImageHeader:
    """Size and orientation from a JPEG, PNG, WebP, BMP or TIFF header; DataError for
    anything else."""
    if data[:2] == b"\xff\xd8":
        return _jpeg_header(data)
    if data[:8] == _PNG and len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return ImageHeader(width, height, _png_orientation(data))
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_header(data)
    if data[:2] == b"BM":
        return _bmp_header(data)
    if data[:4] in _TIFF_ORDER:
        return _tiff_header(data)
    raise DataError("bad-image", "not a JPEG, PNG, WebP, BMP or TIFF (no valid header)")


def header_size(data: bytes) -> tuple[int, int]:
    """(width, height) as stored, from the header; DataError for anything else."""
    header = read_header(data)
    return header.width, header.height


def _jpeg_header(data: bytes) -> ImageHeader:
    # Walks the segments up to the start of scan, as PIL does: an EXIF APP1 is normally
    # first, but one written after the frame header still counts for PIL.
    i, n, size, orientation = 2, len(data), None, None
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
        if marker == 0xDA:  # start of scan: no header segment follows
            break
        end = i + 2 + struct.unpack(">H", data[i + 2: i + 4])[0]
        if marker in _SOF and size is None and i + 9 <= n:
            height, width = struct.unpack(">HH", data[i + 5: i + 9])
            size = (width, height)
        elif marker == 0xE1 and orientation is None and data[i + 4: i + 10] == b"Exif\0\0":
            orientation = tiff_orientation(data[i + 10: end])  # the first EXIF block wins
        i = end
    if size is None:
        raise DataError("bad-image", "JPEG header has no frame size (truncated or corrupt)")
    return ImageHeader(*size, orientation or 1)


def scan_start(data: bytes, at: int = 0) -> int | None:
    """Where the first scan of the JPEG at `at` starts (its SOS marker), walking the header's
    segments by their lengths as `_jpeg_header` does (so a thumbnail inside one is skipped
    whole); None for a header that does not lead to a scan."""
    i, n = at + 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker in _STANDALONE:
            i += 2
        elif marker == 0xDA:
            return i
        else:
            i += 2 + struct.unpack(">H", data[i + 2: i + 4])[0]
    return None


def whole_jpeg(data: bytes, at: int = 0) -> bool:
    """Whether the JPEG at `at` has an end-of-image marker after its scan starts: a file cut
    short has none (0xFFD9 never occurs inside entropy-coded data). One before the scan does
    not count: an EXIF thumbnail or a comment holding a JPEG carries its own. The last marker
    is looked for from the end, so a whole file answers at once."""
    scan = scan_start(data, at)
    return scan is not None and data.rfind(b"\xff\xd9", scan) >= 0


def _png_orientation(data: bytes) -> int:
    """The orientation in a PNG's eXIf chunk (before or after the image data, as PIL reads
    it); 1 without one. Only chunk headers are read: the walk skips over the data."""
    i, n = 8, len(data)
    while i + 8 <= n:
        length = struct.unpack(">I", data[i: i + 4])[0]
        kind = data[i + 4: i + 8]
        if kind == b"eXIf":
            exif = data[i + 8: i + 8 + length]
            return tiff_orientation(exif[6:] if exif.startswith(b"Exif\0\0") else exif)
        if kind == b"IEND":
            break
        i += 12 + length  # length, type, data, CRC
    return 1


def tiff_orientation(tiff: bytes) -> int:
    """The Orientation tag of the first IFD of an EXIF (TIFF) block: 1-8, or 1 when it is
    absent, out of range or unreadable (as PIL, which then leaves the image as stored)."""
    value = _tiff_tags(tiff, {_ORIENTATION_TAG}).get(_ORIENTATION_TAG)
    return value if value is not None and value in ORIENTATIONS else 1


_TIFF_ORDER = {b"II*\0": "<", b"MM\0*": ">"}
_WIDTH_TAG, _LENGTH_TAG = 256, 257


def _tiff_tags(tiff: bytes, wanted: set[int]) -> dict[int, int]:
    """The wanted tags of a TIFF block's first IFD whose value is one SHORT (the standard's
    type for these) or LONG (off-standard, but PIL reads it); what cannot be read is left
    out."""
    order = _TIFF_ORDER.get(tiff[:4])
    if order is None or len(tiff) < 8:
        return {}
    ifd = struct.unpack(order + "I", tiff[4:8])[0]
    if ifd + 2 > len(tiff):
        return {}
    found: dict[int, int] = {}
    count = struct.unpack(order + "H", tiff[ifd: ifd + 2])[0]
    for at in range(ifd + 2, min(ifd + 2 + 12 * count, len(tiff) - 11), 12):
        tag, kind = struct.unpack(order + "HH", tiff[at: at + 4])
        if tag not in wanted or tag in found:
            continue
        if kind == 3:
            found[tag] = struct.unpack(order + "H", tiff[at + 8: at + 10])[0]
        elif kind == 4:
            found[tag] = struct.unpack(order + "I", tiff[at + 8: at + 12])[0]
    return found


def _tiff_header(data: bytes) -> ImageHeader:
    tags = _tiff_tags(data, {_WIDTH_TAG, _LENGTH_TAG, _ORIENTATION_TAG})
    if _WIDTH_TAG not in tags or _LENGTH_TAG not in tags:
        raise DataError("bad-image", "TIFF header has no image size in its first IFD "
                        "(truncated or corrupt)")
    orientation = tags.get(_ORIENTATION_TAG, 1)
    return ImageHeader(tags[_WIDTH_TAG], tags[_LENGTH_TAG],
                       orientation if orientation in ORIENTATIONS else 1)


def _webp_header(data: bytes) -> ImageHeader:
    """The first chunk's size: a lossy (VP8) or lossless (VP8L) bitstream, or the extended
    format's canvas (VP8X), whose EXIF chunk may give an orientation."""
    fourcc = data[12:16]
    if fourcc == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])  # 14 bits each, 2 of scaling
        return ImageHeader(width & 0x3FFF, height & 0x3FFF)
    if fourcc == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = struct.unpack("<I", data[21:25])[0]
        return ImageHeader((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if fourcc == b"VP8X" and len(data) >= 30:
        if data[20] & 0x02:
            raise DataError("bad-image", "an animated WebP: the loaders decode still images "
                            "(make_shards stores its first frame as PNG)")
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return ImageHeader(width, height, _webp_orientation(data))
    raise DataError("bad-image", "WebP header has no frame size (truncated or corrupt)")


def _webp_orientation(data: bytes) -> int:
    """The orientation in an extended WebP's EXIF chunk (with or without the "Exif\0\0"
    prefix, as PIL reads it); 1 without one."""
    for kind, start, length in webp_chunks(data):
        if kind == b"EXIF":
            exif = data[start: start + length]
            return tiff_orientation(exif[6:] if exif.startswith(b"Exif\0\0") else exif)
    return 1


def webp_chunks(data: bytes) -> Iterator[tuple[bytes, int, int]]:
    """(fourcc, where its data starts, its length) of each chunk of a WebP's RIFF body, in
    order: only chunk headers are read."""
    i, n = 12, len(data)
    while i + 8 <= n:
        kind, length = data[i: i + 4], struct.unpack("<I", data[i + 4: i + 8])[0]
        yield kind, i + 8, length
        i += 8 + length + (length & 1)  # chunks are padded to an even length


def _bmp_header(data: bytes) -> ImageHeader:
    """The DIB header's size: the OS/2 core header (12 bytes, 16-bit sides) or the Windows
    ones (40 bytes and up, 32-bit sides; a negative height is stored top-down)."""
    dib = struct.unpack("<I", data[14:18])[0] if len(data) >= 18 else 0
    if dib == 12 and len(data) >= 22:
        width, height = struct.unpack("<HH", data[18:22])
        return ImageHeader(width, height)
    if dib >= 40 and len(data) >= 26:
        width, height = struct.unpack("<ii", data[18:26])
        return ImageHeader(width, abs(height))
    raise DataError("bad-image", "BMP header has no image size (truncated or corrupt)")


def check_header(data: bytes, max_pixels: int) -> ImageHeader:
    """The header, with the size checked against `max_pixels` before anything is decoded.
    An empty member is no image: "missing-field", as the loaders say of an absent one."""
    if not data:
        raise DataError("missing-field", "the image is empty (0 bytes)")
    header = read_header(data)
    width, height = header.width, header.height
    if width < 1 or height < 1:
        raise DataError("bad-image", f"header declares a {width}x{height} image")
    if width * height > max_pixels:
        raise DataError("too-many-pixels", f"header declares {width}x{height} pixels, more "
                        f"than max_pixels={max_pixels}")
    return header
