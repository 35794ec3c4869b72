"""Bad files as real bytes, shared by the bad-input suites: tars with hostile members, pickles
that would act if unpickled, and images that lie about their size."""

from __future__ import annotations

import io
import pathlib
import pickle
import tarfile
import zlib
from pathlib import Path

import numpy as np
from conftest import jpeg_bytes
from PIL import Image

HTML_PAGE = (b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>\n<body>"
             + b"<p>The requested shard was not found on this server.</p>\n" * 20
             + b"</body></html>\n")
ABSURD = 2**50  # a member declaring a petabyte


class Payload:
    """Unpickling this touches `marker`: proof that nothing from the data was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def tar_bytes(members: list) -> bytes:
    """A GNU tar of (name, bytes) pairs and ready-made TarInfos (links, devices)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tar.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                tar.addfile(info, io.BytesIO(m[1]))
    return buf.getvalue()


def special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    if kind == tarfile.CHRTYPE:
        info.devmajor, info.devminor = 1, 3  # /dev/null
    return info


def member_info(data: bytes, name: str) -> tarfile.TarInfo:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.getmember(name)


def declare_size(data: bytes, name: str, size: int) -> bytes:
    """Patch the size field of `name`'s header (GNU base-256) and fix the header checksum."""
    off = member_info(data, name).offset
    b = bytearray(data)
    b[off + 124:off + 136] = b"\x80" + size.to_bytes(11, "big")
    b[off + 148:off + 156] = b" " * 8
    b[off + 148:off + 156] = b"%06o\0 " % sum(b[off:off + 512])
    return bytes(b)


def npy_bytes(arr: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, arr, allow_pickle=arr.dtype.hasobject)
    return out.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A tiny 8x8 PNG whose IHDR (CRC fixed) claims width x height: a decompression bomb."""
    b = bytearray(jpeg_bytes(0, (8, 8), "L", "PNG"))
    assert b[12:16] == b"IHDR"
    b[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    b[29:33] = zlib.crc32(bytes(b[12:29])).to_bytes(4, "big")
    return bytes(b)


def png16() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.arange(12 * 16, dtype=np.uint16).reshape(12, 16) * 300).save(out, "PNG")
    return out.getvalue()


# -- point clouds ------------------------------------------------------------------------------

def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def npy_header(descr: str, shape: tuple[int, ...], body: bytes = b"") -> bytes:
    """A version 1.0 .npy file with any header (np.save would refuse some of these)."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    text += " " * (63 - (len(text) + 10) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode() + body


class _Opens:
    """Unpickling this calls open(path, "w"): the marker file appears if anything unpickles."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.path), "w")


def good(seed: int, n: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32)


def bad_samples(marker: Path) -> dict[str, tuple[dict[str, bytes], str]]:
    """key -> (members, the reason it is refused for)."""
    nan, inf, same = good(1), good(2), np.ones((30, 3), np.float32)
    nan[7, 1], inf[3, 2] = np.nan, -np.inf
    evil = npy_header("|O", (2,), pickle.dumps(np.array([_Opens(marker), 1], dtype=object)))
    return {
        "nan": ({"npy": npy(nan), "cls": b"1"}, "non-finite"),
        "inf": ({"npy": npy(inf), "cls": b"1"}, "non-finite"),
        "empty": ({"npy": npy(np.zeros((0, 3), np.float32)), "cls": b"1"}, "empty"),
        "single": ({"npy": npy(good(3, 1)), "cls": b"1"}, "degenerate"),
        "identical": ({"npy": npy(same), "cls": b"1"}, "degenerate"),
        "pickled": ({"npy": evil, "cls": b"1"}, "object-dtype"),
        "complex": ({"npy": npy(good(4).astype(np.complex64)), "cls": b"1"}, "bad-dtype"),
        "flat": ({"npy": npy(good(5).ravel()), "cls": b"1"}, "bad-shape"),
        "two-columns": ({"npy": npy(good(6)[:, :2]), "cls": b"1"}, "bad-shape"),
        "huge": ({"npy": npy_header("<f4", (3_000_000, 3), bytes(1200)), "cls": b"1"},
                 "too-many-points"),
        "cut": ({"npy": npy(good(7))[:-50], "cls": b"1"}, "truncated"),
        "noise": ({"npy": b"not a numpy file at all" * 4, "cls": b"1"}, "bad-format"),
        "nolabel": ({"npy": npy(good(8))}, "missing-field"),
        "nopoints": ({"cls": b"1"}, "missing-field"),
        "badlabel": ({"npy": npy(good(9)), "cls": b"9"}, "label-out-of-range"),
    }
