"""The point-cloud reader stage's work on each sample, before the graph: `.npy` header ->
checks (refuse, or rewrite as plain little-endian float data; relative to an offset where
float32 would round a cloud far from the origin) -> point count -> the sample's parameters
(rows kept, angle, scale, jitter) for the graph.

Bad clouds are found here where the header tells: object or other wrong dtype, wrong shape,
empty or single point, more than max_points, truncated. Nothing is unpickled, and nothing
allocated before the header is checked.

Everything random is drawn in numpy from (seed, epoch, key) and fed to the graph: the angle,
the scale, which points are kept and the jitter. DALI's random operators are stateful per
pipeline, so a resumed loader or a rebuilt graph would draw other values; these do not depend
on the batch, the rank, the reader or a resume. Evaluation (train=False) keeps evenly spaced
points (or repeats the cloud to pad it) and does not augment.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np

from shardflow.errors import DataError
from shardflow.loading.rng import sample_rng
from shardflow.pointcloud.config import AugmentSpec
from shardflow.samples import pointcloud_io

# numpy refuses .npy headers above 10,000 bytes by default; this covers the magic, the length
# field and such a header.
NPY_HEAD_BYTES = 10_240


def check_npy(data: np.ndarray, max_points: int) -> tuple[np.ndarray, int, np.ndarray | None]:
    """(the `.npy` bytes DALI is to decode, their point count, the float64 offset (3,) taken
    from their x, y, z or None): checked from the header alone (DataError with
    pointcloud_io's reasons), and rewritten as little-endian C-order version 1.0 when they
    are not (DALI's decoder refuses big-endian data, and needs CUDA for Fortran order).

    A cloud the float32 cast would damage (float64 or wide integers far from the origin:
    geographic coordinates, in shards other tools wrote) is rewritten relative to an offset,
    as make_shards stores it (pointcloud_io.precision_offset): points + offset are the file's
    coordinates, the loader returns the offset as batch.offset."""
    if not len(data):
        raise DataError("missing-field", "no .npy member")
    version, shape, fortran, dtype, start = npy_header(data)
    _check_header(shape, dtype, max_points, len(data) - start)
    if _cast_may_lose(dtype) and not _cast_keeps(data, shape, fortran, dtype, start):
        array = _loaded(data)
        offset = pointcloud_io.precision_offset(array)
        if offset is not None:
            relative = array.astype(np.float64)
            relative[:, :3] -= offset
            return _plain(relative), shape[0], offset
    if version == (1, 0) and dtype.byteorder != ">" and not (fortran and shape[1] > 1):
        return data, shape[0], None
    return _repacked(data), shape[0], None


def _cast_may_lose(dtype: np.dtype) -> bool:
    """Whether float32 may round values of `dtype`: float64, and integers of 4 bytes or
    more (float32 holds integers exactly up to 2**24 only)."""
    return dtype.itemsize > 4 or (dtype.kind in "iu" and dtype.itemsize == 4)


def _cast_keeps(data: np.ndarray, shape: tuple[int, ...], fortran: bool, dtype: np.dtype,
                start: int) -> bool:
    """Whether the float32 cast certainly keeps x, y, z within OFFSET_PRECISION of the extent
    (then precision_offset gives None too): it rounds a value v by at most |v| * 2**-24, so
    the columns' bounds, taken from a view of the bytes, decide most clouds without the
    copies a load and precision_offset make (9 ms for 120,000 float64 points; this, 0.3)."""
    count = shape[0] * shape[1]
    if len(data) - start < count * dtype.itemsize:
        return False  # cut short: the load names it
    flat = np.frombuffer(data, dtype, count, start)
    xyz = flat.reshape(shape, order="F" if fortran else "C")[:, :3]
    # column by column: numpy reduces a strided column 20x faster than along axis 0
    low = np.array([float(xyz[:, i].min()) for i in range(3)])
    high = np.array([float(xyz[:, i].max()) for i in range(3)])
    largest = float(np.maximum(np.abs(low), np.abs(high)).max())
    if not np.isfinite(largest) or largest >= float(np.finfo(np.float32).max):
        return False  # NaN, or beyond float32: the slow path decides
    extent = float((high - low).max())
    return largest * 2.0**-24 <= pointcloud_io.OFFSET_PRECISION * extent


# A header's version, shape, Fortran order, dtype, and where the data starts.
Header = tuple[tuple[int, int], tuple[int, ...], bool, np.dtype, int]
# What np.save writes for a 2-D array of a plain number type. numpy's own header parser (a
# literal_eval) took 150 us a cloud: as long as DALI took to decode 2,048 points.
_PLAIN = re.compile(rb"\x93NUMPY\x01\x00..\{'descr': '([<>|](?:f[248]|[iu][1248]))', "
                    rb"'fortran_order': (False|True), 'shape': \((\d{1,12}), (\d{1,12})\), \} *\n",
                    re.DOTALL)


def npy_header(data: np.ndarray) -> Header:
    """The header of `.npy` bytes (uint8): version, shape, Fortran order, dtype, and where the
    data starts; DataError when numpy cannot read it."""
    head = data[:NPY_HEAD_BYTES].tobytes()
    return _plain_header(head) or _any_header(head)


def _plain_header(head: bytes) -> Header | None:
    match = _PLAIN.match(head)
    if match is None or match.end() != 10 + int.from_bytes(head[8:10], "little"):
        return None
    descr, fortran, rows, columns = match.groups()
    return ((1, 0), (int(rows), int(columns)), fortran == b"True", np.dtype(descr.decode()),
            match.end())


def _any_header(head: bytes) -> Header:
    """numpy's parser, for every header the fast pattern does not take."""
    fp = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(fp)
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read is None:
            raise ValueError(f"format version {version} is not 1.0 or 2.0")
        shape, fortran, dtype = read(fp)
    except ValueError as exc:
        raise DataError("bad-format", f"not a readable .npy header: {exc}") from None
    return version, shape, fortran, dtype, fp.tell()


def _check_header(shape: tuple[int, ...], dtype: np.dtype, max_points: int, present: int
                  ) -> None:
    if dtype.hasobject:
        raise DataError("object-dtype", f"dtype {dtype} would need pickle; refused")
    if dtype.names is not None or dtype.subdtype is not None or dtype.kind not in "iuf":
        raise DataError("bad-dtype", f"dtype {dtype}; expected a real integer or float dtype")
    if len(shape) != 2 or shape[1] < 3:
        raise DataError("bad-shape", f"shape {shape}; expected (N, C) with C >= 3 (x, y, z)")
    if shape[0] == 0:
        raise DataError("empty", "the cloud has no points")
    if shape[0] == 1:
        raise DataError("degenerate", "a single point has no extent")
    if shape[0] > max_points:
        raise DataError("too-many-points", f"header declares {shape[0]} points, more than "
                        f"max_points={max_points}")
    needed = shape[0] * shape[1] * dtype.itemsize
    if needed > present:
        raise DataError("truncated", f"header declares {shape} of {dtype} ({needed} bytes) "
                        f"but {present} bytes follow")


def _repacked(data: np.ndarray) -> np.ndarray:
    """Big-endian, Fortran-order or version 2.0 `.npy` as the plain form."""
    return _plain(_loaded(data))


def _loaded(data: np.ndarray) -> np.ndarray:
    """The array of `.npy` bytes whose header was checked (so the size is bounded);
    allow_pickle=False all the same."""
    try:
        return np.load(io.BytesIO(data.tobytes()), allow_pickle=False)
    except ValueError as exc:
        raise DataError("bad-format", f"unreadable .npy data: {exc}") from None


def _plain(array: np.ndarray) -> np.ndarray:
    """`array` as the `.npy` bytes of little-endian C-order float32, version 1.0 (uint8)."""
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(array, dtype="<f4"), allow_pickle=False)
    return np.frombuffer(out.getvalue(), dtype=np.uint8)


@dataclass(frozen=True)
class SampleParams:
    """What the graph does to one cloud: keep rows `index` (int32, num_points; repeats pad a
    small cloud), scale by `scale` (a factor, or one per axis: a negative one mirrors), turn
    by `angle` degrees about z, move by `shift` (or None), add `noise` (or None). A scene's
    crop box is centred on its kept row `centre` (or None: no box)."""

    index: np.ndarray
    angle: float = 0.0
    scale: float | np.ndarray = 1.0
    noise: np.ndarray | None = None
    shift: np.ndarray | None = None
    centre: int | None = None

    def scales(self) -> np.ndarray:
        """float32 (3,): the factor of each axis."""
        return np.broadcast_to(np.asarray(self.scale, np.float32), (3,)).copy()


def sample_params(cfg: AugmentSpec, points: int, key: str, epoch: int) -> SampleParams:
    """The parameters of the cloud `key` (with `points` rows) in `epoch`: drawn from
    (seed, epoch, key) when training; evenly spaced rows and no augmentation otherwise."""
    if cfg.scene:
        return scene_params(cfg, points, key, epoch)
    if not cfg.train:
        return SampleParams(eval_index(points, cfg.num_points))
    rng = np.random.default_rng(sample_rng(cfg.seed, epoch, key).getrandbits(64))
    index = train_index(rng, points, cfg.num_points)
    angle = float(rng.uniform(-cfg.rotate, cfg.rotate))
    scale = float(rng.uniform(*cfg.scale))
    noise = None
    if cfg.jitter:
        noise = rng.standard_normal((cfg.num_points, 3), dtype=np.float32) * np.float32(
            cfg.jitter)
    return SampleParams(index, angle, scale, noise)


def train_index(rng: np.random.Generator, points: int, wanted: int) -> np.ndarray:
    """`wanted` distinct rows at random, or all rows plus random repeats, shuffled."""
    if points >= wanted:
        return rng.choice(points, wanted, replace=False).astype(np.int32)
    index = np.concatenate([np.arange(points), rng.integers(0, points, wanted - points)])
    rng.shuffle(index)
    return index.astype(np.int32)


def eval_index(points: int, wanted: int) -> np.ndarray:
    """Evenly spaced rows; a small cloud repeated whole until `wanted` rows."""
    if points >= wanted:
        return (np.arange(wanted, dtype=np.int64) * points // wanted).astype(np.int32)
    return (np.arange(wanted) % points).astype(np.int32)


def scene_params(cfg: AugmentSpec, points: int, key: str, epoch: int) -> SampleParams:
    """A scene's parameters: every row (or `frame_points` drawn, in file order, training
    only) and, training, a turn about z, a scale (each of x and y mirrored with probability
    1/2 when flipping), a shift (x and y with std `translate`, z a quarter of it), jitter,
    and the row a crop box centres on. Evaluation keeps every row, unaugmented."""
    if not cfg.train:
        return SampleParams(np.arange(points, dtype=np.int32))
    rng = np.random.default_rng(sample_rng(cfg.seed, epoch, key).getrandbits(64))
    index = np.arange(points, dtype=np.int32)
    if cfg.frame_points is not None and points > cfg.frame_points:
        index = np.sort(rng.choice(points, cfg.frame_points, replace=False)).astype(np.int32)
    angle = float(rng.uniform(-cfg.rotate, cfg.rotate))
    scale = np.full(3, rng.uniform(*cfg.scale), np.float32)
    if cfg.flip:
        scale[:2] *= np.where(rng.random(2) < 0.5, -1, 1).astype(np.float32)
    shift = None
    if cfg.translate:
        shift = (rng.standard_normal(3) * [1.0, 1.0, 0.25] * cfg.translate).astype(np.float32)
    noise = None
    if cfg.jitter:
        noise = rng.standard_normal((len(index), 3), dtype=np.float32) * np.float32(
            cfg.jitter)
    centre = int(rng.integers(len(index))) if cfg.crop_box else None
    return SampleParams(index, angle, scale, noise, shift, centre)
