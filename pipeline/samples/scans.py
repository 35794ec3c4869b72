"""A LiDAR scan as make_shards stores it: the points and one label per point, checked.

    points file (.bin: float32 x point_dims; .npy, .ply, .xyz, .off)  [+ labels file]
      -> the table in its own dtype, the label column taken out (--label-column), or the
         labels from their own file (SemanticKITTI's `.label`: uint32, class in the low 16
         bits, instance in the high 16)
      -> the learning map (raw class -> training class, SemanticKITTI's YAML), if any
      -> checks: finite points (pointcloud_io), one label per point, whole labels in
         [0, 65535], every raw class in the map
      -> {"npy": float32 (N, C), "labels.npy": uint16 (N,), offset if far from the origin,
          "__label_counts__": {label: points}} (counted into the manifest by the job)

The labels are stored apart from the points (KEY.labels.npy), so the points stay the `.npy`
every point-cloud reader of this project takes, and the loader reads the labels only when
asked for them (pointcloud_loader per_point_labels=True).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.errors import DataError
from shardflow.samples import pointcloud_io

LABELS_EXT = "labels.npy"
LABEL_COUNTS = "__label_counts__"  # a sample's {label: points}, for the manifest
SCAN_EXTS = ("bin", *pointcloud_io.EXTENSIONS)
LAYOUTS = ("classes", "scans", "kitti")
MAX_LABEL = 65_535  # stored as uint16: SemanticKITTI's raw classes reach 259
NO_IGNORE = -100  # the ignore label when the shards name none (torch's cross-entropy default)


@dataclass(frozen=True)
class ScanOptions:
    """How make_shards reads point clouds (its --layout, --point-dims, --label-column,
    --learning-map, --ignore-label). `classes`: one subfolder per class, a label per cloud
    (the classification layout); `scans` and `kitti` hold scenes labelled per point, or
    scenes without labels where none has any (convert/scan_plan.py). `point_dims` reads
    every .bin, in class folders too."""

    layout: str = "classes"
    point_dims: int = 4  # float32 values per point of a .bin (KITTI 4, nuScenes 5)
    label_column: str | None = None  # a column name (PLY) or index (any table) of labels
    # raw class -> training class, from the YAML's learning_map; recorded in the job's
    # arguments, so a resumed job with another map at that path is refused
    learning_map: tuple[tuple[int, int], ...] | None = None
    class_names: tuple[str, ...] | None = None  # per training class, from the YAML
    ignore_label: int | None = None  # the class that marks unlabelled points, if any
    learning_map_sha256: str | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: choose one of {', '.join(LAYOUTS)}")
        if not 3 <= self.point_dims <= 64:
            raise ValueError(f"point_dims={self.point_dims}: x, y, z and up to 61 more values")
        if self.ignore_label is not None and not 0 <= self.ignore_label <= MAX_LABEL:
            raise ValueError(f"ignore_label={self.ignore_label}: a class in [0, {MAX_LABEL}]")
        given = [name for name, on in (
            ("--label-column", self.label_column is not None),
            ("--learning-map", self.learning_map is not None),
            ("--ignore-label", self.ignore_label is not None)) if on]
        if self.layout == "classes" and given:
            raise ValueError(f"{', '.join(given)}: for scenes labelled per point; pass "
                             "--layout scans or --layout kitti")
        if self.layout == "kitti" and self.label_column is not None:
            raise ValueError("--label-column: SemanticKITTI's labels are its .label files; "
                             "the column is for --layout scans")

    @property
    def per_point(self) -> bool:
        return self.layout != "classes"

    @property
    def num_classes(self) -> int | None:
        """Training classes when a learning map says: its largest target other than the
        ignore label, + 1 (an ignore label of 255 adds no 255 classes)."""
        if self.learning_map is None:
            return None
        return max((t for _, t in self.learning_map if t != self.ignore_label), default=-1) + 1


def with_learning_map(opts: ScanOptions, path: str | Path) -> ScanOptions:
    """`opts` with the learning map, class names and (unless given) ignore label 0 of a
    SemanticKITTI-style YAML: `learning_map` (raw -> training class), optional `labels`
    (raw -> name) and `learning_map_inv` (training -> raw). Loaded with yaml.safe_load: no
    tag of the file can run code."""
    import yaml

    raw = Path(path).read_bytes()
    try:
        doc = yaml.safe_load(raw)
        mapping = _classes_of(dict(doc["learning_map"]))
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a learning map (a YAML with learning_map: "
                         f"{{raw: class}}, classes in [0, {MAX_LABEL}]): {exc}") from None
    ignore = opts.ignore_label if opts.ignore_label is not None else _unlabelled(doc, mapping)
    count = max((t for t in mapping.values() if t != ignore), default=-1) + 1
    names = _class_names(doc, count)
    from dataclasses import replace

    return replace(opts, learning_map=tuple(sorted(mapping.items())), class_names=names,
                   ignore_label=ignore, learning_map_sha256=hashlib.sha256(raw).hexdigest())


def _classes_of(table: dict) -> dict[int, int]:
    """{raw: class}, each a whole number in [0, MAX_LABEL] (a YAML 1.7, true or -1 is
    refused, not read as 1 or as the last class), no raw class twice."""
    def whole(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)) or \
                not str(value).isdigit() or int(value) > MAX_LABEL:
            raise ValueError(f"{value!r} is not a class in [0, {MAX_LABEL}]")
        return int(value)

    mapping: dict[int, int] = {}
    for key, value in table.items():
        if whole(key) in mapping:
            raise ValueError(f"raw class {key!r} is mapped twice")
        mapping[whole(key)] = whole(value)
    if not mapping:
        raise ValueError("learning_map is empty")
    return mapping


def _unlabelled(doc: dict, mapping: dict[int, int]) -> int:
    """The default ignore label: the training class of the raw class named "unlabeled" (or
    "unlabelled", "ignore") in the YAML's `labels`, else 0, SemanticKITTI's."""
    labels = doc.get("labels")
    for raw, name in (labels.items() if isinstance(labels, dict) else ()):
        if str(name).lower() in ("unlabeled", "unlabelled", "ignore", "ignored"):
            with contextlib.suppress(ValueError, TypeError, KeyError):
                return mapping[int(raw)]
    return 0


def _class_names(doc: dict, count: int) -> tuple[str, ...] | None:
    """The names of training classes 0..count-1 (labels[learning_map_inv[class]])."""
    labels, inverse = doc.get("labels"), doc.get("learning_map_inv")
    if not isinstance(labels, dict) or not isinstance(inverse, dict):
        return None
    try:
        return tuple(str(labels[int(inverse[t])]) for t in range(count))
    except (KeyError, ValueError, TypeError):
        return None


def scan_members(data: bytes, ext: str, labels: bytes | None, opts: ScanOptions,
                 max_points: int) -> dict[str, object]:
    """One scan's members (see the module docstring); DataError naming what is wrong."""
    try:
        table = _table(data, ext, opts.point_dims, max_points)
        table, column = _take_label_column(table, opts.label_column, data, ext)
        points, offset = _points(table, max_points)
    except pointcloud_io.PointCloudFormatError as exc:
        raise DataError(exc.reason, str(exc)) from None
    values = _file_labels(labels, len(points)) if labels is not None else \
        _column_labels(column, len(points))
    values = _mapped(values, opts.learning_map)
    out: dict[str, object] = {"npy": _npy(points), LABELS_EXT: _npy(values.astype("<u2"))}
    if offset is not None:
        out[pointcloud_io.OFFSET_EXT] = pointcloud_io.offset_npy(offset)
    counts = np.bincount(values)
    out[LABEL_COUNTS] = {int(c): int(counts[c]) for c in np.flatnonzero(counts)}
    return out


def cloud_members(data: bytes, ext: str, point_dims: int, max_points: int
                  ) -> dict[str, object]:
    """A cloud stored without labels of its own (a class folder's, an unlabelled scan):
    {"npy": float32 (N, C)}, and its offset if far from the origin; a .bin is read as
    `point_dims` float32 values per point. DataError naming what is wrong."""
    try:
        points, offset = _points(_table(data, ext, point_dims, max_points), max_points)
    except pointcloud_io.PointCloudFormatError as exc:
        raise DataError(exc.reason, str(exc)) from None
    out: dict[str, object] = {"npy": _npy(points)}
    if offset is not None:
        out[pointcloud_io.OFFSET_EXT] = pointcloud_io.offset_npy(offset)
    return out


def _table(data: bytes, ext: str, dims: int, max_points: int) -> np.ndarray:
    if ext == "bin":
        return pointcloud_io.read_bin(data, dims, max_points=max_points)
    return pointcloud_io.read_raw(data, ext, max_points=max_points)


def _take_label_column(table: np.ndarray, spec: str | None, data: bytes, ext: str
                       ) -> tuple[np.ndarray, np.ndarray | None]:
    """(the table without its label column, that column); the table as it is without one."""
    if spec is None:
        return table, None
    if table.ndim != 2:
        return table, None  # check_points says why
    index = _column_index(spec, table.shape[1], data, ext)
    if index < 3:
        raise DataError("bad-label-column", f"--label-column {spec} is column {index}, one "
                        "of x, y, z")
    keep = [c for c in range(table.shape[1]) if c != index]
    return table[:, keep], np.asarray(table[:, index])


def _column_index(spec: str, columns: int, data: bytes, ext: str) -> int:
    """A column by index (negative from the end), or by name for a PLY."""
    try:
        index = int(spec)
    except ValueError:
        names = pointcloud_io.ply_columns(data) if ext == "ply" else []
        if spec not in names:
            raise DataError("bad-label-column", f"no column {spec!r} (columns: "
                            f"{names or 'unnamed: give an index'})") from None
        return names.index(spec)
    if not -columns <= index < columns:
        raise DataError("bad-label-column", f"--label-column {index}: the file has "
                        f"{columns} columns")
    return index % columns


def _points(table: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray | None]:
    offset = pointcloud_io.precision_offset(table)
    if offset is not None:
        table = np.array(table, dtype=np.float64)
        table[:, :3] -= offset
    return pointcloud_io.check_points(table, max_points=max_points), offset


def _file_labels(data: bytes, points: int) -> np.ndarray:
    """SemanticKITTI's `.label`: uint32 per point, the class in the low 16 bits."""
    if len(data) != 4 * points:
        raise DataError("label-count", f"the labels file holds {len(data)} bytes, "
                        f"{len(data) / 4:g} labels for {points} points")
    return (np.frombuffer(data, dtype="<u4") & 0xFFFF).astype(np.int64)


def _column_labels(column: np.ndarray | None, points: int) -> np.ndarray:
    if column is None:
        raise DataError("missing-labels", "no labels: pass --label-column, or put a "
                        "SemanticKITTI .label file beside the scan")
    with np.errstate(invalid="ignore"):
        whole = np.isfinite(column) & (column == np.round(column)) if column.dtype.kind == "f" \
            else np.ones(len(column), bool)
    bad = np.flatnonzero(~whole | (column < 0) | (column > MAX_LABEL))
    if bad.size:
        raise DataError("bad-label", f"{bad.size} of {points} labels are not whole numbers in "
                        f"[0, {MAX_LABEL}] (row {bad[0]}: {column[bad[0]]})")
    return column.astype(np.int64)


def _mapped(values: np.ndarray, learning_map: tuple[tuple[int, int], ...] | None
            ) -> np.ndarray:
    """Raw classes through the learning map; DataError naming a raw class it lacks."""
    if learning_map is None:
        return values
    table = np.full(MAX_LABEL + 1, -1, np.int64)
    raw, target = np.array(learning_map, np.int64).T
    inside = raw <= MAX_LABEL
    table[raw[inside]] = target[inside]
    out = table[values]
    missing = np.flatnonzero(out < 0)
    if missing.size:
        raise DataError("unknown-label", f"raw class {values[missing[0]]} ({missing.size} "
                        "points) is not in the learning map")
    return out


def check_labels_member(data: bytes, max_points: int) -> None:
    """A stored KEY.labels.npy on its own (verify_shards): a readable .npy of at most
    max_points whole labels, never unpickled. The loader checks it against the points."""
    count, _dtype, _start = labels_header(data)
    if count > max_points:
        raise DataError("too-many-points", f"{count} labels, more than max_points="
                        f"{max_points}")


def check_labels(data: Any, rows: int, num_classes: int | None, ignore_label: int
                 ) -> np.ndarray:
    """A scene's labels member (uint8 bytes) as an integer array of `rows` labels, read from
    the header first (samples/scans.labels_header); DataError when it is missing, not one
    whole label per point, or a label is neither a class nor the ignore label: below 0 or
    above 65535 always, at or above num_classes when that is known."""
    if data is None:
        raise DataError("missing-labels", "no .labels.npy member (convert with make_shards "
                        "--layout kitti|scans and labels; read clouds without labels with "
                        "labels=False, not per_point_labels)")
    raw = data.tobytes() if hasattr(data, "tobytes") else bytes(data)
    count, dtype, start = labels_header(raw)
    if count != rows:
        raise DataError("label-count", f"{count} labels for {rows} points")
    array = np.frombuffer(raw, dtype=dtype, count=count, offset=start)
    if not len(array):
        return array
    top = MAX_LABEL if num_classes is None else num_classes - 1
    wrong = ((array < 0) | (array > top)) & (array != ignore_label)
    if wrong.any():
        raise DataError("bad-label", f"label {array[wrong][0]} is outside [0, {top}] and not "
                        f"the ignore label {ignore_label}")
    return array


def labels_header(data: bytes) -> tuple[int, np.dtype, int]:
    """(labels, dtype, where they start) of a labels member, from its header alone, checked:
    1-D, a plain integer dtype, every byte present. Nothing is allocated for a header that
    declares more than the member holds."""
    try:
        fp = io.BytesIO(data)
        version = np.lib.format.read_magic(fp)
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read is None:
            raise ValueError(f"format version {version}")
        shape, fortran, dtype = read(fp)  # the header only: nothing allocated yet
    except (ValueError, EOFError) as exc:
        raise DataError("bad-labels", f"labels are not a readable .npy: {exc}") from None
    if len(shape) != 1 or dtype.kind not in "iu" or dtype.hasobject or dtype.names:
        raise DataError("bad-labels", f"labels of shape {shape} and dtype {dtype}; expected "
                        "one integer per point")
    if len(data) - fp.tell() < shape[0] * dtype.itemsize:
        raise DataError("truncated", f"labels header declares {shape[0]} labels of {dtype}, "
                        "but fewer bytes follow")
    return shape[0], dtype, fp.tell()


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()
