"""Checks of one sample's content: images decode, text is clean UTF-8, clouds are finite.

Used by make_shards (nothing bad reaches a shard) and verify_shards (nothing bad stayed in
one). Every failure is a DataError with a short reason code; nothing from the data is
executed: pickle members are refused by name and `.npy` is loaded with allow_pickle=False.
"""

from __future__ import annotations

import io
import json
import logging
import re
import warnings
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image

from shardflow.errors import DataError
from shardflow.samples import headers, jpegscan, masks, pointcloud_io, scans
from shardflow.samples.downsize import GRAY16_MODES, KEPT_FOR_MASK, Downsize, downsized, gray16

log = logging.getLogger(__name__)
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif", "ppm", "pgm")
# The image members the loaders and verify_shards take, in order of preference: each
# extension in lower or upper case (cameras and some tools write .JPG).
IMAGE_MEMBERS = (*IMAGE_EXTS, *(ext.upper() for ext in IMAGE_EXTS))
POINTCLOUD_EXTS = ("npy", "ply", "off", "xyz")
TEXT_EXTS = ("txt",)
# A document stored as token ids (pipeline/text/pretokenized.py): uint16 or uint32 ids.
TOKEN_EXTS = ("tokens.u16", "tokens.u32")
PICKLE_EXTS = ("pyd", "pkl", "pickle", "pth", "pt", "ckpt", "joblib")
# The member beside `npy` of a cloud stored relative to an offset (cloud_members): float64 (3,)
OFFSET_EXT = pointcloud_io.OFFSET_EXT
# What the image loader decodes (headers.py reads their sizes; DALI's CPU decoder and PIL give
# the same pixels of each), by PIL's format name, with the extension make_shards stores it
# under: kept byte for byte. Anything else is re-encoded to PNG. MPO is a JPEG followed by
# more images: the loaders decode its first one, as PIL does. An animated PNG is kept where
# every decoder gives the same picture of it (_png_problem).
KEEP_FORMATS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp",
                "TIFF": "tiff"}
# The TIFF modes both decoders give the same pixels of (measured: DALI's libtiff refuses
# 1-bit, and rounds palette and 16-bit images a level apart from PIL; CMYK goes through a
# fallback). Other TIFFs, and multi-page ones, are stored as PNG.
TIFF_MODES = ("RGB", "RGBA", "L")
_ORIENTATION = 0x0112  # the EXIF tag
# How far into a file PIL cannot identify a JPEG start-of-image marker is looked for (bytes
# put in front by a broken download or tool: a BOM, an HTTP header); what precedes it is cut.
PREFIX_LIMIT = 4096
JPEG_QUALITY = 95  # re-encoding a JPEG the loaders would refuse and no cut repairs


def modality_of(exts: set[str]) -> str:
    """A shard set's modality from its members' extensions (either case): the first of
    image, text, pointcloud, tabular it has members of; "unknown" without (dotted members
    such as `left.jpg` name no modality: the loaders read none of them)."""
    lower = {ext.lower() for ext in exts}
    for modality, names in (("image", set(IMAGE_EXTS)), ("text", {*TEXT_EXTS, *TOKEN_EXTS}),
                            ("pointcloud", set(POINTCLOUD_EXTS)), ("tabular", {"npz"})):
        if lower & names:
            return modality
    return "unknown"


@dataclass(frozen=True)
class CheckLimits:
    """Bounds applied before allocating: pixels per image, bytes per text, points per cloud.
    `downsize`: at conversion only (prepare_image), images made smaller (downsize.py); the
    checks of verify and the loaders never change an image."""

    max_pixels: int = 64_000_000
    max_text_bytes: int = 16 * 1024 * 1024
    max_points: int = 2_000_000
    downsize: Downsize | None = None

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_text_bytes", "max_points"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be a positive integer")


def allow_pixels(max_pixels: int) -> None:
    """Let PIL open what `max_pixels` allows. Image.open refuses an image over twice
    Image.MAX_IMAGE_PIXELS (179M pixels by default) before our limit is asked, so a larger
    max_pixels was PIL's limit, not the caller's. Only then is PIL's raised, to half of it
    (PIL has no limit per call, so for the whole process: said in the log); a lower
    max_pixels, the default's 64M included, changes nothing, and None (PIL's limit turned
    off) is left as it is."""
    current = Image.MAX_IMAGE_PIXELS
    if current is not None and max_pixels > 2 * current:
        Image.MAX_IMAGE_PIXELS = -(-max_pixels // 2)
        log.info("PIL.Image.MAX_IMAGE_PIXELS raised from %d to %d for this process, so that "
                 "images of up to max_pixels=%d open", current, Image.MAX_IMAGE_PIXELS,
                 max_pixels)


def check_image(data: bytes, limits: CheckLimits) -> str:
    """The one decodability rule: PIL decodes all of the image (a JPEG at 1/8 scale, which
    reads every block; pixel limit checked from the header first) and the loaders would
    decode it too (JPEG, PNG, WebP, BMP, TIFF; a JPEG header DALI and the loader's header
    parser read, once a header they repair is repaired: jpegscan.readable). Returns PIL's
    format; DataError says why not."""
    data = jpegscan.readable(data)
    fmt = _decode(data, limits)
    problem = loader_problem(data, fmt)
    if problem is not None:
        reason = "bad-jpeg-structure" if fmt in ("JPEG", "MPO") else "unsupported-image-format"
        raise DataError(reason, f"{problem}; the loaders would refuse it (make_shards repairs "
                        "it: `shardflow convert shards` rewrites them)")
    return fmt


def _decode(data: bytes, limits: CheckLimits) -> str:
    """PIL's decode of every byte (a JPEG's entropy data in full, at 1/8 scale); its format
    name, or DataError."""
    if not data:  # as headers.check_header says it, for the loaders and ShardDataset
        raise DataError("missing-field", "the image is empty (0 bytes)")
    allow_pixels(limits.max_pixels)
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > limits.max_pixels:
                raise DataError("too-many-pixels", f"image declares {width}x{height} pixels, "
                                f"more than max_pixels={limits.max_pixels}")
            if img.format in ("JPEG", "MPO"):
                # At 1/8 scale (DCT-domain): libjpeg still entropy-decodes every block, so a
                # truncated or corrupt JPEG fails as it fails in full
                # (tests/test_cheap_check.py over 660 damaged files), and the inverse DCTs are
                # skipped (1.5x faster at 400 px, more on large photos)
                img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img.load()
            return str(img.format)
    except DataError:
        raise
    except Image.DecompressionBombError as exc:
        raise DataError("too-many-pixels", str(exc)) from None
    except Image.UnidentifiedImageError:
        raise DataError("bad-image", "not an image in any format PIL knows") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise DataError("bad-image", f"image does not decode: {exc}") from None


def loader_problem(data: bytes, fmt: str) -> str | None:
    """Why the image loader would refuse bytes PIL decoded as `fmt`; None when it reads them.
    A strict structural check, as DALI's JPEG parser and augment.header_size read a header
    (decoding in DALI per image would cost a pipeline run per file)."""
    if fmt not in KEEP_FORMATS:
        return f"a {fmt} image; the loaders decode JPEG, PNG, WebP, BMP and TIFF"
    if fmt == "PNG":  # PIL found IHDR first, where the header parser reads the size
        return _png_problem(data)
    if fmt in ("WEBP", "BMP", "TIFF"):
        return _still_problem(data, fmt)
    try:
        found = jpegscan.scan(data)
    except jpegscan.JpegStructureError as exc:
        return f"JPEG header: {exc}"
    return f"JPEG header: {found.problems[0]}" if found.problems else None


def _still_problem(data: bytes, fmt: str) -> str | None:
    """Why the loaders would not read a WebP, BMP or TIFF that PIL decoded: more than one
    frame, a TIFF mode the decoders disagree on, or a header whose size is not PIL's."""
    with Image.open(io.BytesIO(data)) as img:
        frames, mode, size = getattr(img, "n_frames", 1), img.mode, img.size
    if frames > 1:
        return f"a {fmt} of {frames} frames; the loaders decode still images"
    if fmt == "TIFF" and mode not in TIFF_MODES:
        return f"a TIFF in mode {mode}; the loaders read {', '.join(TIFF_MODES)} TIFFs"
    if fmt == "WEBP" and _exif_after_odd_chunk(data):
        return ("a WebP whose EXIF chunk follows a chunk of odd length, which DALI's WebP "
                "parser cannot read")
    try:
        header = headers.read_header(data)
    except DataError as err:
        return f"{fmt} header: {err.detail}"
    # PIL's TIFF plugin gives a TIFF's size upright (it turns the pixels as it loads them)
    said = header.upright_size() if fmt == "TIFF" else (header.width, header.height)
    if said != size:
        return f"{fmt} header says {said[0]}x{said[1]}, PIL decodes {size[0]}x{size[1]}"
    return None


def _png_problem(data: bytes) -> str | None:
    """An animated PNG whose default image (IDAT) is not a frame of its animation: DALI
    decodes the animation's first frame, PIL and the portable backend the default image, two
    pictures. The default image is taken as the image (reencode_png keeps it alone): it is
    what every viewer without APNG support shows, and what PIL gives. An APNG whose default
    image is its first frame (the usual kind) gives every decoder that picture: kept."""
    with Image.open(io.BytesIO(data)) as img:
        # acTL, then IDAT before any fcTL (PIL reads to the first IDAT as it opens)
        if not img.info.get("default_image"):
            return None
        frames = getattr(img, "n_frames", 1) - 1  # PIL counts the default image as one
    return (f"an animated PNG of {frames} frames whose default image is not one of them; "
            "DALI decodes the first frame, PIL the default image")


def _exif_after_odd_chunk(data: bytes) -> bool:
    """DALI 2.x's WebP parser walks the chunks to the EXIF one without the padding byte that
    follows a chunk of odd length, and fails ("Unexpected end of stream"; PIL and the
    portable backend read the file). Measured on 600 WebPs (lossy and lossless, ICC, XMP):
    every file it failed on has such a chunk before EXIF; 2 it read had one too."""
    odd = False
    for kind, _start, length in headers.webp_chunks(data):
        if kind == b"EXIF":
            return odd
        odd = odd or bool(length % 2)
    return False


@dataclass(frozen=True)
class PreparedImage:
    """What make_shards stores for an input image: bytes the loaders decode, the member
    extension, and the repairs made (empty: the original bytes)."""

    data: bytes
    ext: str
    repairs: tuple[str, ...] = ()


def prepare_image(data: bytes, limits: CheckLimits) -> PreparedImage:
    """Apply the rule at conversion: what PIL reads but the loaders would not is repaired,
    losslessly where a cut does it (bytes before the start-of-image marker, bytes between
    header segments, short APP segments PIL cannot parse), else re-encoded (JPEG quality 95;
    PNG for other formats, alpha and 16-bit). What PIL cannot read stays a DataError. With
    `limits.downsize`, then made smaller (downsize.py), counted as one more repair."""
    try:
        fmt = _decode(data, limits)
    except DataError as err:
        if err.reason != "bad-image":
            raise
        prepared = _repair_unreadable(data, limits, err)
    else:
        prepared = _fit_for_loader(data, fmt, limits, ())
    small = downsized(prepared.data, limits.downsize) if limits.downsize else None
    if small is None:
        return prepared
    return PreparedImage(small[0], small[1], (*prepared.repairs, small[2]))


def _repair_unreadable(data: bytes, limits: CheckLimits, err: DataError) -> PreparedImage:
    """Two kinds of file PIL cannot open that a lossless cut makes readable: a JPEG after
    stray leading bytes, and a JPEG with an APP0/APP14 segment too short for PIL's parser."""
    if data[:2] != jpegscan.SOI:
        start = data.find(jpegscan.SOI + b"\xff", 0, PREFIX_LIMIT)
        if start <= 0:
            raise err
        fixed, repair = data[start:], "bytes-before-soi"
    else:
        try:
            found = jpegscan.scan(data)
        except jpegscan.JpegStructureError:
            raise err from None
        if not found.short_app:
            raise err
        fixed, repair = jpegscan.rebuild(data, found), "short-app-segment"
    try:
        fmt = _decode(fixed, limits)
    except DataError:
        raise err from None  # not a repairable file after all: PIL's first word stands
    return _fit_for_loader(fixed, fmt, limits, (repair,))


def _fit_for_loader(data: bytes, fmt: str, limits: CheckLimits, repairs: tuple[str, ...]
                    ) -> PreparedImage:
    """Bytes PIL decoded as `fmt`, kept, rebuilt or re-encoded so that the loaders read them."""
    if loader_problem(data, fmt) is None:
        return PreparedImage(data, KEEP_FORMATS[fmt], repairs)
    if fmt in ("JPEG", "MPO"):
        fixed = _rebuilt_jpeg(data, limits)
        if fixed is not None:
            return PreparedImage(fixed, "jpg", (*repairs, "jpeg-header-junk"))
        return PreparedImage(reencode_jpeg(data), "jpg", (*repairs, "jpeg-reencoded"))
    name = "apng" if fmt == "PNG" else fmt.lower()  # a PNG is re-encoded for its frames
    return PreparedImage(reencode_png(data), "png", (*repairs, f"{name}-to-png"))


def _rebuilt_jpeg(data: bytes, limits: CheckLimits) -> bytes | None:
    """The header rebuilt without what libjpeg skipped, when that satisfies the loaders and
    PIL still decodes it (it reads the same segments, so the pixels are the same)."""
    try:
        fixed = jpegscan.rebuild(data, jpegscan.scan(data))
        fmt = _decode(fixed, limits)
    except (jpegscan.JpegStructureError, DataError):
        return None
    return fixed if fmt in ("JPEG", "MPO") and loader_problem(fixed, fmt) is None else None


def reencode_jpeg(data: bytes) -> bytes:
    """A JPEG the loaders would refuse, re-encoded at quality 95 from PIL's pixels (gray stays
    gray, everything else RGB), EXIF kept so that the orientation still applies."""
    with Image.open(io.BytesIO(data)) as img:
        exif = img.info.get("exif")
        out_img = img.convert("L" if img.mode in ("L", "1") else "RGB")
        out = io.BytesIO()
        out_img.save(out, format="JPEG", quality=JPEG_QUALITY, **({"exif": exif} if exif else {}))
        return out.getvalue()


def reencode_png(data: bytes) -> bytes:
    """Lossless PNG of an image the loaders do not read as it is (GIF, an animated WebP's
    first frame, a CMYK TIFF...), its EXIF orientation kept (an eXIf chunk of that tag
    alone), so that it still turns upright as the loaders would turn the original; 16-bit
    grey stays 16-bit (I;16, whichever byte order or width PIL read it in), a palette a
    palette."""
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # first: PIL's TIFF plugin turns its pixels upright and drops the tag
        orientation = _exif_orientation(img.info)
        if img.mode in GRAY16_MODES:
            img = gray16(img)
        if img.mode == "F":  # no range to map to 8 or 16 bits: RGB would clip it to 0..255
            raise DataError("unsupported-image-format", "a floating-point image (PIL mode F): "
                            "its values have no fixed range to store in 8 or 16 bits; convert "
                            "it to 8- or 16-bit first, with the scaling that suits it")
        # A palette stays a palette: the loaders read palette PNGs as they read the GIF,
        # and a label map's indices (a mask kept as GIF) stay its labels.
        if img.mode not in ("RGB", "RGBA", "L", "LA", "I;16", "P"):
            img = img.convert("RGBA" if "A" in img.getbands() or "transparency" in img.info
                              else "RGB")
        exif = Image.Exif()
        if orientation in range(2, 9):
            exif[_ORIENTATION] = orientation
        out = io.BytesIO()
        img.save(out, format="PNG", **({"exif": exif} if len(exif) else {}))
        return out.getvalue()


def _exif_orientation(info: dict[str | tuple[int, int], object]) -> int:
    """The orientation of the image's EXIF block, read by the loaders' parser (headers.py);
    not PIL's getexif(), which falls back to XMP and PNG text chunks the loaders never read
    (a tag added from one would turn an image the original did not)."""
    raw = info.get("exif")
    if not isinstance(raw, bytes):
        return 1
    return headers.tiff_orientation(raw[6:] if raw.startswith(b"Exif\0\0") else raw)


def check_text(data: bytes, limits: CheckLimits) -> str:
    if len(data) > limits.max_text_bytes:
        raise DataError("text-too-large", f"document has {len(data)} bytes, more than "
                        f"max_text_bytes={limits.max_text_bytes}; split it or raise the limit")
    return text_of(data)


def text_of(data: bytes) -> str:
    """The document in `data`: strict UTF-8, no NUL byte, not empty or only whitespace
    (`check_text` without the size limit, for a loader that has cut the document already)."""
    text = utf8_of(data)
    if not text or text.isspace():  # what `not text.strip()` says, without a copy
        raise DataError("empty-text", "document is empty or only whitespace")
    return text


def utf8_of(data: bytes, nul_ok: bool = False) -> str:
    """Text in `data`: strict UTF-8 and (unless `nul_ok`) no NUL byte; empty is text too. The
    one rule for documents, captions and every text member."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError("bad-utf8", f"not valid UTF-8 at byte {exc.start}") from None
    if not nul_ok and "\x00" in text:
        raise DataError("nul-byte", f"text holds a NUL byte at character {text.index(chr(0))}")
    return text


def json_of(data: bytes) -> Any:
    """A JSON member parsed by json.loads alone (nothing in it is evaluated)."""
    try:
        return json.loads(utf8_of(data, nul_ok=True))
    except RecursionError:  # "[[[[..." deeper than Python's stack
        raise DataError("bad-json", "JSON nests too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, and integers of more than 4300 digits
        raise DataError("bad-json", f"not JSON: {exc}") from None


def check_points(data: bytes, ext: str, limits: CheckLimits) -> bytes:
    """Parse a point cloud and return it as `.npy` bytes of float32 (N, C)."""
    try:
        points = pointcloud_io.read_points(data, ext, max_points=limits.max_points)
    except pointcloud_io.PointCloudFormatError as exc:
        raise DataError(exc.reason, str(exc)) from None
    return _npy(points)


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def cloud_members(data: bytes, ext: str, limits: CheckLimits) -> dict[str, bytes]:
    """A point-cloud file as make_shards stores it: {"npy": float32 (N, C)}, and for a cloud
    the float32 cast would move by more than 1e-6 of its extent (geographic coordinates) the
    points relative to a float64 offset, which goes beside them as OFFSET_EXT; the point-cloud
    loader returns it as batch.offset (points + offset: the file's coordinates)."""
    try:
        points, offset = pointcloud_io.read_points_offset(data, ext,
                                                          max_points=limits.max_points)
    except pointcloud_io.PointCloudFormatError as exc:
        raise DataError(exc.reason, str(exc)) from None
    if offset is None:
        return {"npy": _npy(points)}
    return {"npy": _npy(points), OFFSET_EXT: pointcloud_io.offset_npy(offset)}


def check_offset(data: bytes) -> np.ndarray:
    """An OFFSET_EXT member: 3 finite float64 values."""
    try:
        return pointcloud_io.read_offset(data)
    except pointcloud_io.PointCloudFormatError as exc:
        raise DataError(exc.reason, str(exc)) from None


_LABEL = re.compile(rb"\s*([+-]?[0-9]+)\s*")  # ASCII digits; \s is ASCII whitespace for bytes


def check_label(data: bytes, num_classes: int | None = None) -> int:
    """A `.cls` member: ASCII decimal integer, within [0, num_classes) when that is known."""
    # Stricter than int(): it would take "1_000" and non-ASCII digits, and labels past int64
    # would overflow the batch's label tensor.
    found = _LABEL.fullmatch(data) if len(data) <= 64 else None
    if found is None:
        raise DataError("bad-label", f"label {data[:40]!r} is not an integer")
    label = int(found.group(1))
    if not -(2**63) <= label < 2**63:
        raise DataError("label-out-of-range", f"label {data[:40]!r} does not fit in int64")
    if label < 0 or (num_classes is not None and label >= num_classes):
        bound = f"[0, {num_classes})" if num_classes is not None else ">= 0"
        raise DataError("label-out-of-range", f"label {label} is not in {bound}")
    return label


def check_member(ext: str, data: bytes, limits: CheckLimits, num_classes: int | None) -> None:
    """Check one stored member by its extension; unknown extensions pass as opaque bytes."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last in PICKLE_EXTS:
        raise DataError("pickle-member", f"member .{ext} is a pickle; shardflow never "
                        "unpickles sample data")
    if last in IMAGE_EXTS:
        check_image(data, limits)
    elif last in TEXT_EXTS:
        check_text(data, limits)
    elif ext.lower() == OFFSET_EXT:
        check_offset(data)
    elif ext.lower() == scans.LABELS_EXT:
        scans.check_labels_member(data, limits.max_points)
    elif last == "npy":
        check_points(data, "npy", limits)
    elif last == "cls":
        check_label(data, num_classes)


def repair_sample(sample: dict[str, object], limits: CheckLimits) -> dict[str, object]:
    """A sample of existing shards as make_shards stores it: every member checked, image
    members the loaders would refuse repaired (`prepare_image`) and renamed when the stored
    format changed (a .gif member becomes .png); the repairs listed under "__repairs__". A
    sample of several images (a mask beside its image) is not downsized (`_kept_whole`). The
    error carries the sample's key and URL."""
    key, url = str(sample.get("__key__", "")), str(sample.get("__url__", ""))
    limits, kept = _kept_whole(sample, limits)
    out: dict[str, object] = {}
    repairs: list[str] = []
    for ext, data in sample.items():
        try:
            if ext == masks.MASK_EXT:  # a label map: never "repaired" into colours
                masks.check_mask(data, _image_size(sample))  # type: ignore[arg-type]
            elif _is_image(ext):
                image = prepare_image(data, limits)  # type: ignore[arg-type]
                if image.repairs:
                    ext, data = _renamed(ext, image.ext, sample), image.data
                    repairs += image.repairs
            elif not ext.startswith("__"):
                check_member(ext, data, limits, None)  # type: ignore[arg-type]
        except DataError as err:
            raise err.located(source=url, key=key) from None
        out[ext] = data
    if repairs or kept:
        out["__repairs__"] = (*repairs, *((KEPT_FOR_MASK,) if kept else ()))
    return out


def _is_image(ext: str) -> bool:
    return not ext.startswith("__") and ext.rsplit(".", 1)[-1].lower() in IMAGE_EXTS


def _kept_whole(sample: dict[str, object], limits: CheckLimits) -> tuple[CheckLimits, bool]:
    """The limits to repair the sample's images with, and whether --max-side would have
    changed one of them. Images whose pixels must stay aligned with each other (a `.seg.png`
    mask, or a second image member: maybe a mask or depth map under another name) are never
    resized or turned: each alone would no longer fit the other (a Lanczos-resized label map,
    stored as JPEG, would even have new labels). Kept as they are and counted, no sample
    lost; the other repairs keep the pixel grid and still apply."""
    if limits.downsize is None or sum(_is_image(ext) for ext in sample) < 2:
        return limits, False
    sizes = [_stored_size(data) for ext, data in sample.items()  # type: ignore[arg-type]
             if _is_image(ext) and ext != masks.MASK_EXT]
    kept = any(limits.downsize.acts_on(size) for size in sizes)
    return replace(limits, downsize=None), kept


def _stored_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the header (headers.py: nothing decoded, no pixel limit met
    before the member's own check names it), else PIL's for the formats the header parser
    does not read (GIF...); (0, 0) where neither can (the member's check says why later)."""
    try:
        return headers.header_size(data)
    except DataError:
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                return img.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return (0, 0)


def _renamed(ext: str, stored: str, sample: dict[str, object]) -> str:
    """The member's extension for bytes re-encoded as `stored` ("jpg" or "png"): unchanged
    when it already names that format (or the new name is taken), else its last part
    replaced, so that extension and content agree."""
    head, _, last = ext.rpartition(".")
    family = {"jpeg": "jpg"}.get(last.lower(), last.lower())
    new = f"{head}.{stored}" if head else stored
    return ext if family == stored or new in sample else new


def check_sample(sample: dict[str, object], limits: CheckLimits,
                 num_classes: int | None = None) -> None:
    """Check every member of a sample; the error carries the sample's key and URL."""
    key, url = str(sample.get("__key__", "")), str(sample.get("__url__", ""))
    for ext, data in sample.items():
        if ext.startswith("__"):
            continue
        try:
            check_member(ext, data, limits, num_classes)  # type: ignore[arg-type]
        except DataError as err:
            raise err.located(source=url, key=key) from None
    if masks.MASK_EXT in sample:  # after the image's own check: its size is then known good
        try:
            masks.check_mask(sample[masks.MASK_EXT], _image_size(sample))  # type: ignore[arg-type]
        except DataError as err:
            raise err.located(source=url, key=key) from None


def _image_size(sample: dict[str, object]) -> tuple[int, int]:
    """(width, height) of the sample's image, as stored; DataError when it has none."""
    for ext, data in sample.items():
        if not ext.startswith("__") and ext.rsplit(".", 1)[-1].lower() in IMAGE_EXTS \
                and ext != masks.MASK_EXT:
            try:
                with Image.open(io.BytesIO(data)) as img:  # type: ignore[arg-type]
                    return img.size
            except (OSError, ValueError, SyntaxError):
                raise DataError("bad-image", "not an image in any format PIL knows") from None
    raise DataError("bad-mask", f"a .{masks.MASK_EXT} mask without an image")
