"""A block of tabular rows as one tar member (`KEY.npz`): what make_shards' tabular kind writes
and what the tabular loader reads, so both sides share one definition of the format.

A block is a NumPy `.npz` (a zip of `.npy` arrays), written here with fixed timestamps and no
compression so that the same rows give the same bytes, and read with `allow_pickle=False`:

    label.npy        float32 (n,)          0.0 or 1.0
    dense.npy        float32 (n, D)        NaN where the value is missing
    cat_offsets.npy  int32   (F * n + 1,)  field-major: value (f, r) is
    cat_blob.npy     uint8   (bytes,)        cat_blob[cat_offsets[f*n + r]:cat_offsets[f*n + r + 1]]
    dense_names.npy  str     (D,)          the schema, so that a block says what it holds
    cat_names.npy    str     (F,)

Categorical values are UTF-8 bytes; an empty value is a missing one (a null in Parquet, an
empty field in CSV). No object arrays, no pickle: a block never executes anything, and one
that is not exactly this (another member, a compressed member, a wrong dtype or shape,
offsets that run backwards or past the blob) is a DataError naming what is wrong.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass

import numpy as np

from shardflow.errors import DataError

BLOCK_EXT = "npz"
MEMBERS = ("label", "dense", "cat_offsets", "cat_blob", "dense_names", "cat_names")
_DATE = (1980, 1, 1, 0, 0, 0)  # the zip format's earliest date: no clock in the bytes
MAX_BLOB = 2**31 - 1  # int32 offsets


@dataclass(frozen=True)
class TabularSchema:
    """Which column is the label and which are dense (numeric) or categorical features, in
    the order the blocks store them."""

    label: str
    dense: tuple[str, ...]
    categorical: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"label": self.label, "dense": list(self.dense),
                "categorical": list(self.categorical)}

    @classmethod
    def from_json(cls, doc: object) -> TabularSchema:
        if not isinstance(doc, dict) or not isinstance(doc.get("label"), str):
            raise ValueError(f"not a tabular schema: {doc!r:.200}")
        return cls(doc["label"], tuple(map(str, doc.get("dense", ()))),
                   tuple(map(str, doc.get("categorical", ()))))


@dataclass
class Block:
    """The columns of n rows (see the module docstring for shapes and meaning)."""

    label: np.ndarray
    dense: np.ndarray
    cat_offsets: np.ndarray
    cat_blob: np.ndarray
    dense_names: tuple[str, ...]
    cat_names: tuple[str, ...]

    @property
    def rows(self) -> int:
        return int(self.label.shape[0])


def pack_values(fields: list[list[bytes]]) -> tuple[np.ndarray, np.ndarray]:
    """(cat_offsets, cat_blob) of F fields of n values each (bytes, b"" for missing)."""
    flat = [v for values in fields for v in values]
    lengths = np.fromiter((len(v) for v in flat), dtype=np.int64, count=len(flat))
    offsets = np.zeros(len(flat) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > MAX_BLOB:
        raise DataError("block-too-large", f"the block's categorical values take "
                        f"{offsets[-1]} bytes (at most {MAX_BLOB}); use fewer rows per block")
    blob = np.frombuffer(b"".join(flat), dtype=np.uint8)
    return offsets.astype(np.int32), blob


def encode_block(block: Block) -> bytes:
    """The block's `.npz` bytes: the same for the same columns, every time."""
    arrays = {"label": block.label.astype(np.float32, copy=False),
              "dense": block.dense.astype(np.float32, copy=False),
              "cat_offsets": block.cat_offsets.astype(np.int32, copy=False),
              "cat_blob": block.cat_blob.astype(np.uint8, copy=False),
              "dense_names": _names(block.dense_names), "cat_names": _names(block.cat_names)}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in MEMBERS:
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[name]),
                                      allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_DATE)
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())
    return out.getvalue()


def _names(names: tuple[str, ...]) -> np.ndarray:
    return np.array(list(names), dtype=f"<U{max([len(n) for n in names] + [1])}")


def decode_block(data: bytes) -> Block:
    """A block from its `.npz` bytes, checked (DataError "bad-block" naming the problem)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            arrays = _read_members(zf, data)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise DataError("bad-block", f"not a tabular block (.npz): {exc}") from None
    return _checked(arrays)


def _read_members(zf: zipfile.ZipFile, data: bytes) -> dict[str, np.ndarray]:
    infos = {i.filename: i for i in zf.infolist()}
    wanted = {f"{m}.npy" for m in MEMBERS}
    if set(infos) != wanted:
        raise ValueError(f"members {sorted(infos)}, expected {sorted(wanted)}")
    view = memoryview(data)
    return {name: _array(view, infos[f"{name}.npy"]) for name in MEMBERS}


def _array(data: memoryview, info: zipfile.ZipInfo) -> np.ndarray:
    """A stored member's array, read in place (no copy of the block's bytes)."""
    # Stored only: a compressed member could expand without bound before any check.
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
        raise ValueError(f"member {info.filename} is compressed; blocks store members as "
                         "they are")
    local = bytes(data[info.header_offset: info.header_offset + 30])
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise ValueError(f"member {info.filename}: no local header where the index says")
    start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") \
        + int.from_bytes(local[28:30], "little")
    member = data[start: start + info.compress_size]
    if len(member) != info.compress_size:
        raise ValueError(f"member {info.filename} runs past the end of the block")
    f = io.BytesIO(member[:4096])  # the .npy header: magic, version, then a dict literal
    version = np.lib.format.read_magic(f)
    # Parsed as a literal (ast.literal_eval), never executed or unpickled.
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f"member {info.filename}: .npy format {version} is not read here")
    if dtype.hasobject or fortran:
        raise ValueError(f"member {info.filename} holds {dtype} (order F: {fortran}); blocks "
                         "hold plain C-ordered arrays")
    count = int(np.prod(shape, dtype=np.int64))
    if f.tell() + count * dtype.itemsize != len(member):
        raise ValueError(f"member {info.filename}: {shape} {dtype} does not fill its bytes")
    return np.frombuffer(member, dtype=dtype, count=count, offset=f.tell()).reshape(shape)


def _checked(a: dict[str, np.ndarray]) -> Block:
    label, dense, offsets, blob = a["label"], a["dense"], a["cat_offsets"], a["cat_blob"]
    dense_names, cat_names = a["dense_names"], a["cat_names"]
    problem = ""
    if label.dtype != np.float32 or label.ndim != 1:
        problem = f"label is {label.dtype} {label.shape}, expected float32 (n,)"
    elif dense.dtype != np.float32 or dense.ndim != 2 or dense.shape[0] != label.shape[0]:
        problem = f"dense is {dense.dtype} {dense.shape}, expected float32 (n, D)"
    elif dense_names.dtype.kind != "U" or cat_names.dtype.kind != "U" \
            or dense_names.shape != (dense.shape[1],) or cat_names.ndim != 1:
        problem = "the column names do not match the columns"
    elif offsets.dtype != np.int32 or blob.dtype != np.uint8 or blob.ndim != 1 \
            or offsets.shape != (cat_names.shape[0] * label.shape[0] + 1,):
        problem = f"cat_offsets is {offsets.dtype} {offsets.shape} for {cat_names.shape[0]} " \
                  f"fields of {label.shape[0]} rows"
    elif offsets[0] != 0 or offsets[-1] != blob.shape[0] or np.any(np.diff(offsets) < 0):
        problem = "cat_offsets do not run from 0 to the blob's end in order"
    elif not np.all((label == 0) | (label == 1)):
        problem = f"labels other than 0 and 1 (e.g. {label[(label != 0) & (label != 1)][0]})"
    elif np.isinf(dense).any():
        problem = "dense values hold an infinity"
    if problem:
        raise DataError("bad-block", problem)
    return Block(label, dense, offsets, blob, tuple(map(str, dense_names)),
                 tuple(map(str, cat_names)))
