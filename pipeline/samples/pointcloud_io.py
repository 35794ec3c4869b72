"""Read point-cloud files (npy, ply, off, xyz) into validated float32 (N, C) arrays.

Flow: bytes + extension -> format parser -> ``check_points`` -> float32 C-contiguous (N, C),
columns x, y, z first, then any extra per-point channels.

Only numpy and the standard library: we need vertex positions and a few float channels, not a
mesh library. The files come from datasets we do not control, so every parser checks the declared
size against ``max_points`` and against the bytes present before it allocates, and nothing is
ever unpickled or evaluated.

Example::

    points = read_points(sample["ply"], "ply", max_points=100_000)  # (N, C) float32
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Reason = Literal[
    "bad-format",  # not a file of the named format, or a header we cannot follow
    "bad-shape",  # not (N, C) with C >= 3
    "bad-dtype",  # structured, complex, string, bool... anything but real int/float
    "object-dtype",  # object arrays would need pickle
    "too-many-points",  # more than max_points, found before allocating
    "truncated",  # fewer bytes or rows than the header declares
    "empty",  # zero points
    "non-finite",  # NaN or Inf x, y or z (also values that overflow float32)
    "degenerate",  # all x, y, z identical (includes a single point)
    "unknown-ext",  # not one of EXTENSIONS
]
EXTENSIONS = ("npy", "ply", "off", "xyz")
# The member beside `npy` of a cloud stored relative to an offset: float64 (3,)
OFFSET_EXT = "offset.npy"
DEFAULT_MAX_POINTS = 2_000_000


class PointCloudFormatError(ValueError):
    """The file is not a readable point cloud; the message names the reason.

    ``reason`` is a short machine-readable ``Reason`` such as "too-many-points", meant for
    skip counters and reports.
    """

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason: Reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Loader workers pickle exceptions; the default would call __init__(message) alone.
        return (type(self), (self.reason, str(self)))


def read_points(data: bytes, ext: str, *, max_points: int = DEFAULT_MAX_POINTS) -> np.ndarray:
    """Parse one point-cloud file's bytes into float32 (N, C), C >= 3, x y z first.

    ``ext`` is an extension or a WebDataset field name ("ply", ".PLY", "lidar.npy").
    Bad data raises PointCloudFormatError; a bad ``max_points`` raises ValueError.
    """
    return check_points(_parse(data, ext, max_points), max_points=max_points)


def read_raw(data: bytes, ext: str, *, max_points: int = DEFAULT_MAX_POINTS) -> np.ndarray:
    """The file's table in its own dtype, not checked yet (check_points does that): for a
    caller that takes columns out first, as a scan's label column."""
    return _parse(data, ext, max_points)


def read_bin(data: bytes, dims: int, *, max_points: int = DEFAULT_MAX_POINTS) -> np.ndarray:
    """A headerless `.bin` scan (SemanticKITTI's velodyne, nuScenes' lidar): little-endian
    float32, `dims` values per point, row after row; not checked yet."""
    _check_max_points(max_points)
    if len(data) % (4 * dims):
        raise PointCloudFormatError(
            "truncated", f".bin of {len(data)} bytes is not whole points of {dims} float32 "
            f"values ({4 * dims} bytes each): is --point-dims right?")
    if len(data) // (4 * dims) > max_points:
        raise PointCloudFormatError(
            "too-many-points", f".bin holds {len(data) // (4 * dims)} points, more than "
            f"max_points={max_points}")
    return np.frombuffer(data, dtype="<f4").reshape(-1, dims)


def _parse(data: bytes, ext: str, max_points: int) -> np.ndarray:
    """The parser's array, in the file's own dtype (not checked yet)."""
    _check_max_points(max_points)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    parser = _PARSERS.get(ext.rsplit(".", 1)[-1].lower())
    if parser is None:
        raise PointCloudFormatError(
            "unknown-ext", f"unknown point-cloud extension {ext!r}; expected one of {EXTENSIONS}"
        )
    return parser(bytes(data), max_points)


# --- clouds far from the origin ---------------------------------------------------------------

# A float32 cast may move a point by at most this share of the cloud's extent; beyond it (a
# cloud in metres at 5e6 m moves by up to 0.25 m) the coordinates are stored relative to an
# offset. float32 keeps the relative coordinates to about 6e-8 of the extent.
OFFSET_PRECISION = 1e-6


def read_points_offset(data: bytes, ext: str, *, max_points: int = DEFAULT_MAX_POINTS
                       ) -> tuple[np.ndarray, np.ndarray | None]:
    """``read_points`` for clouds that float32 alone would damage: (float32 (N, C) points,
    float64 (3,) offset or None). With an offset, points[:, :3] + offset are the file's
    coordinates; None when the cast moves no point by more than OFFSET_PRECISION of the
    cloud's extent (then the points are read_points's)."""
    raw = _parse(data, ext, max_points)
    offset = precision_offset(raw)
    if offset is not None:
        raw = np.array(raw, dtype=np.float64)
        raw[:, :3] -= offset
    return check_points(raw, max_points=max_points), offset


def precision_offset(points: np.ndarray) -> np.ndarray | None:
    """The float64 offset (3,) to take from x, y, z before the float32 cast, or None when the
    cast alone keeps them within OFFSET_PRECISION of the extent (or the array is one that
    check_points refuses). The box centre rounded to a power of ten no larger than the
    extent: a readable number that leaves every coordinate within one extent of zero."""
    if points.ndim != 2 or points.shape[1] < 3 or points.dtype.names is not None or \
            points.dtype.kind not in "iuf" or len(points) == 0:
        return None
    if points.dtype.kind == "f" and points.dtype.itemsize <= 4:
        return None  # already float32 (or narrower): the cast moves nothing
    xyz = points[:, :3].astype(np.float64)
    if not np.isfinite(xyz).all():
        return None
    low, high = xyz.min(axis=0), xyz.max(axis=0)
    extent = float((high - low).max())
    with np.errstate(over="ignore"):  # beyond float32's range: Inf, "moved" the most
        moved = float(np.abs(xyz.astype(np.float32).astype(np.float64) - xyz).max())
    if extent == 0 or moved <= OFFSET_PRECISION * extent:
        return None
    step = 10.0 ** math.floor(math.log10(extent))
    return np.round((low + high) / 2 / step) * step


def offset_npy(offset: np.ndarray) -> bytes:
    """The `.npy` bytes of an offset: float64 (3,)."""
    out = io.BytesIO()
    np.save(out, np.asarray(offset, dtype=np.float64).reshape(3), allow_pickle=False)
    return out.getvalue()


def read_offset(data: bytes) -> np.ndarray:
    """An offset member back as float64 (3,); PointCloudFormatError unless it is 3 finite
    float64 values (checked from the header before reading: a member of any size may
    arrive under that name)."""
    if len(data) > 1024:
        raise PointCloudFormatError("bad-format", f"offset member has {len(data)} bytes; an "
                                    "offset is 3 float64 values")
    return _check_offset(data)


def _check_offset(raw: bytes) -> np.ndarray:
    try:  # .npy only (np.load would open a zip too), never unpickled
        offset = np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:
        raise PointCloudFormatError("bad-format", f"offset is not a readable .npy: {exc}"
                                    ) from None
    if offset.dtype != np.float64 or offset.shape != (3,) or not np.isfinite(offset).all():
        raise PointCloudFormatError("bad-format", f"offset is {offset.dtype} {offset.shape};"
                                    " expected 3 finite float64 values")
    return offset


def check_points(points: np.ndarray, *, max_points: int = DEFAULT_MAX_POINTS) -> np.ndarray:
    """Validate an (N, C) array and return it as float32 C-contiguous.

    Refuses: not 2-D, C < 3, a dtype other than real int/float, N == 0, N > max_points,
    NaN/Inf in x, y or z (after the float32 cast), and all x, y, z identical ("degenerate").
    Extra channels may hold NaN (a missing intensity): they are not coordinates, and the
    point-cloud loader, which reads x, y, z alone, checks those three only; one rule for the
    loader, its numpy check, ShardDataset and make_shards.
    """
    _check_max_points(max_points)
    if not isinstance(points, np.ndarray):
        raise TypeError(f"points must be a numpy array, got {type(points).__name__}")
    _check_dtype(points.dtype, "point array")
    _check_shape(points.shape, max_points, f"point array of shape {points.shape}")
    # Values beyond float32's range become Inf here and are refused just below.
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.ascontiguousarray(points, dtype=np.float32)
    bad_rows = np.flatnonzero(~np.isfinite(out[:, :3]).all(axis=1))
    if bad_rows.size:
        raise PointCloudFormatError(
            "non-finite",
            f"{bad_rows.size} of {len(out)} points have NaN or Inf x, y or z values "
            f"(first at row {bad_rows[0]})",
        )
    if (out[:, :3] == out[0, :3]).all():
        raise PointCloudFormatError(
            "degenerate", f"all {len(out)} points are at {out[0, :3].tolist()}: zero extent"
        )
    return out


def _check_max_points(max_points: int) -> None:
    if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 1:
        raise ValueError(f"max_points must be a positive int, got {max_points!r}")


def _check_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.hasobject:
        raise PointCloudFormatError(
            "object-dtype", f"{what} has object dtype {dtype}; refused (it would need pickle)"
        )
    if dtype.names is not None or dtype.subdtype is not None or dtype.kind not in "iuf":
        raise PointCloudFormatError(
            "bad-dtype", f"{what} has dtype {dtype}; expected a real integer or float dtype"
        )


def _check_shape(shape: tuple[int, ...], max_points: int, what: str) -> None:
    if len(shape) != 2:
        raise PointCloudFormatError(
            "bad-shape", f"{what}: expected a 2-D (N, C) array with C >= 3 columns"
        )
    if shape[0] == 0:
        raise PointCloudFormatError("empty", f"{what}: no points")
    if shape[1] < 3:
        raise PointCloudFormatError("bad-shape", f"{what}: need >= 3 columns (x, y, z)")
    if shape[0] > max_points:
        raise PointCloudFormatError(
            "too-many-points", f"{what}: {shape[0]} points, more than max_points={max_points}"
        )


# --- .npy -------------------------------------------------------------------------------------

_NPY_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _read_npy(data: bytes, max_points: int) -> np.ndarray:
    fp = io.BytesIO(data)
    shape, dtype = _read_npy_header(fp)
    _check_dtype(dtype, "npy array")
    if any(n < 0 for n in shape):
        raise PointCloudFormatError("bad-format", f"npy header declares shape {shape}")
    _check_shape(shape, max_points, f"npy header declares shape {shape}")
    needed, present = math.prod(shape) * dtype.itemsize, len(data) - fp.tell()
    if needed > present:
        raise PointCloudFormatError(
            "truncated",
            f"npy header declares shape {shape} of {dtype} ({needed} bytes) "
            f"but only {present} bytes follow",
        )
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as err:
        raise PointCloudFormatError("bad-format", f"unreadable .npy data: {err}") from err


def _read_npy_header(fp: io.BytesIO) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from the header alone, so nothing is allocated yet."""
    try:
        version = np.lib.format.read_magic(fp)
    except ValueError as err:
        raise PointCloudFormatError("bad-format", f"not a .npy file: {err}") from err
    read_header = _NPY_HEADER_READERS.get(version)
    if read_header is None:
        # Version 3.0 only adds UTF-8 field names, i.e. structured dtypes we refuse anyway.
        raise PointCloudFormatError("bad-format", f"unsupported .npy format version {version}")
    try:
        shape, _fortran_order, dtype = read_header(fp)
    except ValueError as err:
        raise PointCloudFormatError("bad-format", f"bad .npy header: {err}") from err
    return shape, dtype


# --- .ply -------------------------------------------------------------------------------------

_PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1",
    "short": "i2", "int16": "i2", "ushort": "u2", "uint16": "u2",
    "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}  # fmt: skip
_PLY_BYTE_ORDERS = {"ascii": "", "binary_little_endian": "<", "binary_big_endian": ">"}
_LIST = "list"  # the type code we store for a list property
# The header ends at a line that is end_header alone (trailing blanks and a CR allowed): a
# comment may mention the word, and a bare find would start the body inside the header.
_PLY_END = re.compile(rb"^end_header[ \t\r]*$", re.MULTILINE)


@dataclass
class _PlyElement:
    name: str
    count: int
    props: list[tuple[str, str]] = field(default_factory=list)  # (name, numpy code or _LIST)

    def has_list(self) -> bool:
        return any(code == _LIST for _, code in self.props)

    def dtype(self, byte_order: str) -> np.dtype:
        return np.dtype([(name, byte_order + code) for name, code in self.props])


def _read_ply(data: bytes, max_points: int) -> np.ndarray:
    header, body_start = _split_ply_header(data)
    fmt, elements = _parse_ply_header(header)
    index = next((i for i, e in enumerate(elements) if e.name == "vertex"), None)
    if index is None:
        raise PointCloudFormatError("bad-format", "PLY header has no 'element vertex'")
    vertex, before = elements[index], elements[:index]
    _check_ply_vertex(vertex, max_points)
    if fmt == "ascii":
        skip_rows = sum(e.count for e in before)  # ASCII: one line per element instance
        return _read_ply_ascii(data[body_start:], vertex, skip_rows)
    table = _read_ply_binary(data, body_start + _ply_skip_bytes(before), vertex, fmt)
    return np.stack([table[name] for name in _ply_channel_order(vertex)], axis=1)


def _split_ply_header(data: bytes) -> tuple[list[list[str]], int]:
    """The header's tokenised lines (after 'ply') and the offset where the body starts."""
    if not data.startswith(b"ply"):
        raise PointCloudFormatError("bad-format", "not a PLY file: it does not start with 'ply'")
    found = _PLY_END.search(data)
    if found is None:
        raise PointCloudFormatError("bad-format", "PLY header has no 'end_header' line")
    end = found.start()
    body_start = min(found.end() + 1, len(data))  # past the line's newline, when it has one
    try:
        text = data[:end].decode("ascii")
    except UnicodeDecodeError as err:
        raise PointCloudFormatError("bad-format", f"PLY header is not ASCII: {err}") from err
    return [line.split() for line in text.splitlines()[1:]], body_start


def _parse_ply_header(lines: list[list[str]]) -> tuple[str, list[_PlyElement]]:
    fmt, elements = None, []
    for tokens in lines:
        if not tokens or tokens[0] in ("comment", "obj_info"):
            continue
        if tokens[0] == "format" and len(tokens) == 3:
            fmt = tokens[1]
        elif tokens[0] == "element" and len(tokens) == 3:
            count = _parse_count(tokens[2], "PLY element count")
            elements.append(_PlyElement(tokens[1], count))
        elif tokens[0] == "property" and elements:
            elements[-1].props.append(_ply_property(tokens))
        else:
            raise PointCloudFormatError("bad-format", f"bad PLY header line {' '.join(tokens)!r}")
    if fmt not in _PLY_BYTE_ORDERS:
        raise PointCloudFormatError(
            "bad-format", f"PLY format {fmt!r} is not one of {tuple(_PLY_BYTE_ORDERS)}"
        )
    return fmt, elements


def _parse_count(token: str, what: str) -> int:
    # isascii: str.isdigit() also accepts digits such as '²' that int() refuses.
    if token.isascii() and token.isdigit() and len(token) <= 30:
        return int(token)
    raise PointCloudFormatError("bad-format", f"{what} {token[:40]!r} is not an integer >= 0")


def _ply_property(tokens: list[str]) -> tuple[str, str]:
    if len(tokens) == 5 and tokens[1] == "list":
        return tokens[4], _LIST
    if len(tokens) == 3 and tokens[1] in _PLY_TYPES:
        return tokens[2], _PLY_TYPES[tokens[1]]
    raise PointCloudFormatError("bad-format", f"bad PLY property line {' '.join(tokens)!r}")


def _check_ply_vertex(vertex: _PlyElement, max_points: int) -> None:
    names = [name for name, _ in vertex.props]
    if not {"x", "y", "z"} <= set(names) or len(set(names)) != len(names):
        raise PointCloudFormatError(
            "bad-format", f"PLY vertex properties {names} need x, y, z once each, no duplicates"
        )
    lists = [name for name, code in vertex.props if code == _LIST]
    if lists:
        raise PointCloudFormatError(
            "bad-format", f"PLY vertex list properties {lists} are not supported, only scalars"
        )
    if vertex.count > max_points:
        raise PointCloudFormatError(
            "too-many-points",
            f"PLY header declares {vertex.count} vertices, more than max_points={max_points}",
        )


def ply_columns(data: bytes) -> list[str]:
    """The names of read_points's columns for a PLY file: x, y, z, then the other vertex
    properties in file order (a scan's label column is found among them by name)."""
    header, _ = _split_ply_header(data)
    _, elements = _parse_ply_header(header)
    vertex = next((e for e in elements if e.name == "vertex"), None)
    if vertex is None:
        raise PointCloudFormatError("bad-format", "PLY header has no 'element vertex'")
    return _ply_channel_order(vertex)


def _ply_channel_order(vertex: _PlyElement) -> list[str]:
    extras = [name for name, _ in vertex.props if name not in ("x", "y", "z")]
    return ["x", "y", "z", *extras]


def _ply_skip_bytes(before: list[_PlyElement]) -> int:
    """Bytes taken by the elements stored ahead of the vertices in a binary body."""
    for element in before:
        if element.has_list():
            raise PointCloudFormatError(
                "bad-format",
                f"binary PLY element {element.name!r} comes before 'vertex' and has list "
                "properties, so the vertex data cannot be located without reading it",
            )
    return sum(e.count * e.dtype("").itemsize for e in before)


def _read_ply_binary(data: bytes, offset: int, vertex: _PlyElement, fmt: str) -> np.ndarray:
    dtype = vertex.dtype(_PLY_BYTE_ORDERS[fmt])
    needed = vertex.count * dtype.itemsize
    if offset + needed > len(data):
        raise PointCloudFormatError(
            "truncated",
            f"binary PLY declares {vertex.count} vertices ({needed} bytes) "
            f"but only {max(len(data) - offset, 0)} bytes are left for them",
        )
    return np.frombuffer(data, dtype=dtype, count=vertex.count, offset=offset)


def _read_ply_ascii(body: bytes, vertex: _PlyElement, skip_rows: int) -> np.ndarray:
    n_props = len(vertex.props)
    if vertex.count == 0:
        return np.empty((0, n_props))
    # maxsplit keeps the work to the rows we need; clamp it since a body has <= len + 1 lines.
    stop = min(skip_rows + vertex.count, len(body) + 1)
    lines = body.split(b"\n", stop)[skip_rows:stop]
    table = _loadtxt(_decode(b"\n".join(lines), "ASCII PLY"), "ASCII PLY vertex data")
    if table.shape[0] < vertex.count:
        raise PointCloudFormatError(
            "truncated",
            f"ASCII PLY declares {vertex.count} vertices but has {table.shape[0]} vertex lines",
        )
    if table.shape[1] != n_props:
        raise PointCloudFormatError(
            "bad-format",
            f"ASCII PLY vertex lines have {table.shape[1]} values, header declares {n_props}",
        )
    names = [name for name, _ in vertex.props]
    return table[:, [names.index(name) for name in _ply_channel_order(vertex)]]


# --- .off and .xyz ----------------------------------------------------------------------------

# Blank and comment-only lines: loadtxt would warn about them when max_rows is set.
_EMPTY_LINES = re.compile(r"^[ \t\r\f\v]*(?:#[^\n]*)?(?:\n|\Z)", re.MULTILINE)


def _decode(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PointCloudFormatError("bad-format", f"{what} file is not text: {err}") from err


def _loadtxt(text: str, what: str, max_rows: int | None = None) -> np.ndarray:
    """Whitespace-separated numeric rows as float64 (rows, cols); '#' starts a comment."""
    text = _EMPTY_LINES.sub("", text)
    if not text:
        return np.empty((0, 0))
    try:
        return np.loadtxt(io.StringIO(text), dtype=np.float64, ndmin=2, max_rows=max_rows)
    except ValueError as err:
        message = f"{what} is not a table of numbers: {err}"
        raise PointCloudFormatError("bad-format", message) from err


def _read_xyz(data: bytes, max_points: int) -> np.ndarray:
    # One row past the limit is enough to know the file is too big.
    table = _loadtxt(_decode(data, "XYZ"), "XYZ file", max_rows=max_points + 1)
    if table.shape[0] > max_points:
        raise PointCloudFormatError(
            "too-many-points", f"XYZ file has more than max_points={max_points} rows"
        )
    return table


def _read_off(data: bytes, max_points: int) -> np.ndarray:
    text = _decode(data, "OFF")
    line, pos = _next_content_line(text, 0)
    if not line.startswith("OFF"):
        raise PointCloudFormatError("bad-format", f"OFF file starts with {line[:40]!r}, not 'OFF'")
    counts = line[3:].split()  # ModelNet quirk: 'OFF490 518 0' glues the counts to the keyword
    if not counts:
        counts_line, pos = _next_content_line(text, pos)
        counts = counts_line.split()
    n_vertices = _off_vertex_count(counts, max_points)
    if n_vertices == 0:
        return np.empty((0, 3))
    table = _loadtxt(text[pos:], "OFF vertex data", max_rows=n_vertices)
    if table.shape[0] < n_vertices:
        raise PointCloudFormatError(
            "truncated", f"OFF declares {n_vertices} vertices but has {table.shape[0]}"
        )
    return table[:, :3] if table.shape[1] >= 3 else table  # short rows: check_points says why


def _next_content_line(text: str, pos: int) -> tuple[str, int]:
    """The next line at or after pos without its comment, skipping blanks; and where it ends."""
    while pos < len(text):
        end = text.find("\n", pos)
        end = len(text) if end < 0 else end
        line = text[pos:end].split("#", 1)[0].strip()
        pos = end + 1
        if line:
            return line, pos
    raise PointCloudFormatError("truncated", "OFF file ends inside its header")


def _off_vertex_count(counts: list[str], max_points: int) -> int:
    if len(counts) not in (2, 3):
        raise PointCloudFormatError(
            "bad-format", f"OFF counts line {' '.join(counts)[:60]!r} is not 'nV nF nE'"
        )
    # All counts are validated; only nV is used since faces and edges are not read.
    n_vertices, *_ = [_parse_count(c, "OFF count") for c in counts]
    if n_vertices > max_points:
        raise PointCloudFormatError(
            "too-many-points",
            f"OFF header declares {n_vertices} vertices, more than max_points={max_points}",
        )
    return n_vertices


_PARSERS: dict[str, Callable[[bytes, int], np.ndarray]] = {
    "npy": _read_npy,
    "ply": _read_ply,
    "off": _read_off,
    "xyz": _read_xyz,
}
