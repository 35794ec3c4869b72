"""Tests for samples/pointcloud_io.py: round trips per format, then every bad input we know of."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest

from shardflow.samples.pointcloud_io import PointCloudFormatError, check_points, read_points

RNG = np.random.default_rng(0)
XYZ = RNG.normal(size=(7, 3)).astype(np.float32)

# File order puts an extra channel before x to check that x, y, z come out first.
VERTEX_DTYPE = [("intensity", "f4"), ("x", "f4"), ("y", "f4"), ("z", "f4"), ("label", "u1")]
PLY_TYPE_NAMES = {"f4": "float", "f8": "double", "u1": "uchar", "i4": "int32"}


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def npy_header_only(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    buf = io.BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + b"\0" * 64


def vertex_records(n: int = 7) -> np.ndarray:
    rec = np.zeros(n, dtype=VERTEX_DTYPE)
    rec["x"], rec["y"], rec["z"] = XYZ[:n].T
    rec["intensity"] = np.arange(n) * 0.5
    rec["label"] = np.arange(n) % 3
    return rec


def expected_channels(rec: np.ndarray) -> np.ndarray:
    names = ["x", "y", "z", "intensity", "label"]
    return np.stack([rec[name].astype(np.float32) for name in names], axis=1)


def ply_header(fmt: str, rec: np.ndarray, count: int | None = None, faces: int = 2) -> str:
    props = "".join(
        f"property {PLY_TYPE_NAMES[rec.dtype[name].str[1:]]} {name}\n" for name in rec.dtype.names
    )
    return (
        f"ply\nformat {fmt} 1.0\ncomment made by a test\n"
        f"element vertex {len(rec) if count is None else count}\n{props}"
        f"element face {faces}\nproperty list uchar int vertex_indices\nend_header\n"
    )


def ply_binary(rec: np.ndarray, order: str = "<", count: int | None = None) -> bytes:
    fmt = "binary_little_endian" if order == "<" else "binary_big_endian"
    body = rec.astype(rec.dtype.newbyteorder(order)).tobytes()
    face = np.uint8(3).tobytes() + np.array([0, 1, 2], dtype=order + "i4").tobytes()
    return ply_header(fmt, rec, count).encode() + body + face * 2


def ply_ascii(rec: np.ndarray, count: int | None = None) -> bytes:
    rows = "".join(" ".join(repr(v.item()) for v in row) + "\n" for row in rec)
    return (ply_header("ascii", rec, count) + rows + "3 0 1 2\n3 1 2 3\n").encode()


def text_rows(points: np.ndarray) -> str:
    return "".join(" ".join(repr(float(v)) for v in row) + "\n" for row in points)


def off_bytes(points: np.ndarray, glued: bool = False) -> bytes:
    head = f"OFF{len(points)} 1 0\n" if glued else f"OFF\n# a comment\n\n{len(points)} 1 0\n"
    return (head + "# vertices\n" + text_rows(points) + "\n3 0 1 2\n").encode()


def reason_of(data: bytes, ext: str, **kwargs: int) -> PointCloudFormatError:
    with pytest.raises(PointCloudFormatError) as info:
        read_points(data, ext, **kwargs)
    return info.value


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8, np.float16])
def test_npy_round_trip(dtype: type) -> None:
    array = (XYZ * 10).astype(dtype)
    out = read_points(npy_bytes(array), "npy")
    assert out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, array.astype(np.float32))


def test_npy_fortran_order_and_extra_channels() -> None:
    array = np.asfortranarray(RNG.normal(size=(5, 6)))
    out = read_points(npy_bytes(array), ".NPY")
    assert out.flags.c_contiguous
    np.testing.assert_allclose(out, array.astype(np.float32))


@pytest.mark.parametrize("order", ["<", ">"])
def test_binary_ply_round_trip_with_extras_and_faces(order: str) -> None:
    rec = vertex_records()
    out = read_points(ply_binary(rec, order), "ply")
    np.testing.assert_array_equal(out, expected_channels(rec))


def test_ascii_ply_round_trip_with_extras_and_faces() -> None:
    rec = vertex_records()
    out = read_points(ply_ascii(rec), "sample.ply")
    np.testing.assert_array_equal(out, expected_channels(rec))


def test_ply_type_aliases_and_crlf_header() -> None:
    header = (
        "ply\r\nformat ascii 1.0\r\nelement vertex 2\r\nproperty float32 x\r\n"
        "property float64 y\r\nproperty int16 z\r\nend_header\r\n"
    )
    out = read_points((header + "0 0 1\r\n1.5 2 3\r\n").encode(), "ply")
    np.testing.assert_array_equal(out, [[0, 0, 1], [1.5, 2, 3]])


@pytest.mark.parametrize("where", ["element vertex", "end_header"])
@pytest.mark.parametrize("order", ["<", ">"])
def test_ply_comment_naming_end_header_is_not_the_end(where: str, order: str) -> None:
    # Exporters write comments such as "data follows end_header"; only the line that is
    # end_header alone ends the header. Before the vertex element, the bare word made a valid
    # file read as one without vertices; after it, the body started inside the header.
    rec = vertex_records()
    comment = b"comment exported by a tool; data follows end_header\n"
    data = ply_binary(rec, order).replace(where.encode(), comment + where.encode(), 1)
    np.testing.assert_array_equal(read_points(data, "ply"), expected_channels(rec))
    ascii_data = ply_ascii(rec).replace(where.encode(), comment + where.encode(), 1)
    np.testing.assert_array_equal(read_points(ascii_data, "ply"), expected_channels(rec))


def test_ply_end_header_line_with_trailing_blanks() -> None:
    rec = vertex_records()
    data = ply_binary(rec).replace(b"end_header\n", b"end_header \t\r\n", 1)
    np.testing.assert_array_equal(read_points(data, "ply"), expected_channels(rec))


def test_binary_ply_skips_scalar_element_before_vertex() -> None:
    rec = vertex_records()
    data = ply_binary(rec)
    camera = "element camera 1\nproperty double fx\nproperty double fy\n"
    data = data.replace(b"element vertex", camera.encode() + b"element vertex", 1)
    end = data.index(b"end_header\n") + len(b"end_header\n")
    data = data[:end] + np.array([500.0, 500.0]).tobytes() + data[end:]
    np.testing.assert_array_equal(read_points(data, "ply"), expected_channels(rec))


def test_ascii_ply_skips_list_element_before_vertex() -> None:
    header = (
        "ply\nformat ascii 1.0\nelement face 1\nproperty list uchar int vertex_indices\n"
        "element vertex 2\nproperty float x\nproperty float y\nproperty float z\nend_header\n"
    )
    out = read_points((header + "3 0 1 1\n0 0 0\n1 2 3\n").encode(), "ply")
    np.testing.assert_array_equal(out, [[0, 0, 0], [1, 2, 3]])


@pytest.mark.parametrize("glued", [False, True])
def test_off_round_trip(glued: bool) -> None:
    out = read_points(off_bytes(XYZ, glued=glued), "off")
    np.testing.assert_array_equal(out, XYZ)


def test_modelnet_glued_off_header_literal() -> None:
    data = b"OFF490 518 0\n" + text_rows(RNG.normal(size=(490, 3))).encode() + b"3 0 1 2\n" * 518
    assert read_points(data, "off").shape == (490, 3)


def test_xyz_round_trip_with_comments_and_extra_columns() -> None:
    points = RNG.normal(size=(6, 4))
    data = "# x y z intensity\n\n" + text_rows(points[:3]) + "  # mid comment\n"
    data += text_rows(points[3:])
    out = read_points(data.encode(), "xyz")
    np.testing.assert_allclose(out, points.astype(np.float32))


def test_check_points_returns_float32_contiguous() -> None:
    out = check_points(np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::-1])
    assert out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_array_equal(out[0], [3, 2, 1, 0])


# --- bad inputs ---------------------------------------------------------------------------------


def test_object_npy_refused_without_unpickling() -> None:
    data = npy_bytes(np.array([[object(), 1, 2]], dtype=object))
    err = reason_of(data, "npy")
    assert err.reason == "object-dtype" and "pickle" in str(err)


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((4, 3), dtype=np.complex64),
        np.zeros((4, 3), dtype="S4"),
        np.zeros((4, 3), dtype=bool),
        np.zeros((4, 3), dtype=[("a", "f4")]),
    ],
    ids=["complex", "bytes", "bool", "structured"],
)
def test_npy_bad_dtype(array: np.ndarray) -> None:
    err = reason_of(npy_bytes(array), "npy")
    assert err.reason == "bad-dtype" and str(array.dtype) in str(err)


def test_npy_huge_declared_shape_refused_before_allocation() -> None:
    err = reason_of(npy_header_only((10**12, 3)), "npy")
    assert err.reason == "too-many-points"
    assert "1000000000000" in str(err) and "max_points=2000000" in str(err)


def test_npy_declared_size_beyond_data_is_truncated() -> None:
    err = reason_of(npy_header_only((1000, 3)), "npy")
    assert err.reason == "truncated" and "12000 bytes" in str(err)
    err = reason_of(npy_bytes(XYZ)[:-5], "npy")
    assert err.reason == "truncated"


def test_npy_huge_columns_caught_as_truncated() -> None:
    assert reason_of(npy_header_only((2, 10**15)), "npy").reason == "truncated"


def test_npy_negative_shape_refused() -> None:
    assert reason_of(npy_header_only((-5, 3)), "npy").reason == "bad-format"


def test_ply_huge_vertex_count_refused_before_allocation() -> None:
    err = reason_of(ply_binary(vertex_records(), count=3_000_000_000), "ply")
    assert err.reason == "too-many-points"
    assert str(err) == "PLY header declares 3000000000 vertices, more than max_points=2000000"


def test_truncated_binary_ply() -> None:
    err = reason_of(ply_binary(vertex_records(), count=50), "ply")
    assert err.reason == "truncated" and "50 vertices" in str(err)


def test_ascii_ply_cut_inside_vertex_lines_is_truncated() -> None:
    data = ply_ascii(vertex_records())
    cut = data.index(b"end_header\n") + len(b"end_header\n")
    for _ in range(3):
        cut = data.index(b"\n", cut) + 1
    err = reason_of(data[:cut], "ply")
    assert err.reason == "truncated" and "declares 7 vertices but has 3" in str(err)


def test_ascii_ply_count_beyond_vertex_lines_is_bad_format() -> None:
    # The face lines are read as vertices: the file disagrees with itself, it is not cut short.
    err = reason_of(ply_ascii(vertex_records(), count=50), "ply")
    assert err.reason == "bad-format" and "columns" in str(err)


def test_binary_ply_cut_inside_vertex_block() -> None:
    data = ply_binary(vertex_records())
    end = data.index(b"end_header\n") + len(b"end_header\n")
    assert reason_of(data[: end + 20], "ply").reason == "truncated"


def test_binary_ply_list_element_before_vertex_is_bad_format() -> None:
    data = ply_binary(vertex_records()).replace(
        b"element vertex", b"element edge 1\nproperty list uchar int v\nelement vertex", 1
    )
    err = reason_of(data, "ply")
    assert err.reason == "bad-format" and "'edge'" in str(err) and "list" in str(err)


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        (b"format binary_little_endian", b"format binary_middle_endian", "binary_middle_endian"),
        (b"property float x\n", b"", "x, y, z"),
        (b"property float x", b"property quaternion x", "quaternion"),
        (b"element vertex 7", b"element vertex -7", "-7"),
        (b"element vertex 7", b"element points 7", "vertex"),
        (b"end_header", b"end_headr", "end_header"),
        (b"ply\n", b"PLY!\n", "ply"),
    ],
)
def test_bad_ply_headers(old: bytes, new: bytes, needle: str) -> None:
    data = ply_binary(vertex_records()).replace(old, new, 1)
    err = reason_of(data, "ply")
    assert err.reason == "bad-format" and needle in str(err)


@pytest.mark.parametrize("ext", ["npy", "xyz"])
def test_nan_and_inf_refused(ext: str) -> None:
    points = XYZ.astype(np.float64)
    points[2, 1], points[5, 0] = np.nan, np.inf
    data = npy_bytes(points) if ext == "npy" else text_rows(points).encode()
    err = reason_of(data, ext)
    assert err.reason == "non-finite" and "2 of 7 points" in str(err) and "row 2" in str(err)


def test_float32_overflow_is_non_finite() -> None:
    points = XYZ.astype(np.float64)
    points[0, 0] = 1e300
    assert reason_of(npy_bytes(points), "npy").reason == "non-finite"


@pytest.mark.parametrize(
    ("data", "ext"),
    [
        (npy_bytes(np.zeros((0, 3))), "npy"),
        (b"# only a comment\n\n", "xyz"),
        (b"", "xyz"),
        (b"OFF\n0 0 0\n", "off"),
        (ply_ascii(vertex_records(0)), "ply"),
        (ply_binary(vertex_records(0)), "ply"),
    ],
    ids=["npy", "xyz-comment", "xyz-empty", "off", "ply-ascii", "ply-binary"],
)
def test_zero_points_is_empty(data: bytes, ext: str) -> None:
    err = reason_of(data, ext)
    assert err.reason == "empty" and "no points" in str(err)


@pytest.mark.parametrize("points", [np.ones((1, 3)), np.full((5, 4), 2.0)], ids=["one", "same"])
def test_identical_points_are_degenerate(points: np.ndarray) -> None:
    err = reason_of(npy_bytes(points), "npy")
    assert err.reason == "degenerate" and "zero extent" in str(err)


@pytest.mark.parametrize("ext", ["npy", "xyz"])
def test_nan_in_an_extra_channel_is_kept_as_the_loader_reads_it(ext: str) -> None:
    # x, y, z are the coordinates the loader checks (its graph reads only those): a NaN
    # intensity is no reason to refuse a cloud here and read it there
    points = np.hstack([XYZ, np.ones((7, 1), np.float32)]).astype(np.float64)
    points[3, 3] = np.nan
    data = npy_bytes(points) if ext == "npy" else text_rows(points).encode()
    out = read_points(data, ext)
    assert np.isnan(out[3, 3]) and np.isfinite(out[:, :3]).all()
    points[3, 2] = np.inf
    data = npy_bytes(points) if ext == "npy" else text_rows(points).encode()
    assert reason_of(data, ext).reason == "non-finite"


def test_extra_channels_do_not_rescue_identical_positions() -> None:
    points = np.zeros((4, 4))
    points[:, 3] = np.arange(4)
    assert reason_of(npy_bytes(points), "npy").reason == "degenerate"


@pytest.mark.parametrize(
    "shape", [(5, 2), (5,), (2, 5, 3), (), (5, 0)], ids=["2col", "1d", "3d", "0d", "0col"]
)
def test_bad_shapes(shape: tuple[int, ...]) -> None:
    err = reason_of(npy_bytes(RNG.normal(size=shape)), "npy")
    assert err.reason == "bad-shape" and str(shape) in str(err)


def test_two_column_xyz_is_bad_shape() -> None:
    assert reason_of(b"1 2\n3 4\n", "xyz").reason == "bad-shape"


@pytest.mark.parametrize("ext", ["npy", "ply", "off", "xyz"])
def test_too_many_points_with_small_limit(ext: str) -> None:
    makers = {
        "npy": lambda: npy_bytes(XYZ),
        "ply": lambda: ply_ascii(vertex_records()),
        "off": lambda: off_bytes(XYZ),
        "xyz": lambda: text_rows(XYZ).encode(),
    }
    err = reason_of(makers[ext](), ext, max_points=5)
    assert err.reason == "too-many-points" and "max_points=5" in str(err)
    assert read_points(makers[ext](), ext, max_points=7).shape[0] == 7


@pytest.mark.parametrize("ext", ["npy", "ply", "off", "xyz"])
def test_garbage_bytes_are_bad_format(ext: str) -> None:
    garbage = RNG.integers(0, 256, size=300, dtype=np.uint8).tobytes()
    for data in (garbage, b"<html><body>502 Bad Gateway</body></html>"):
        err = reason_of(data, ext)
        assert err.reason == "bad-format" and str(err)


def test_inconsistent_xyz_columns() -> None:
    err = reason_of(b"1 2 3\n4 5 6 7\n", "xyz")
    assert err.reason == "bad-format" and "columns" in str(err)


def test_non_numeric_xyz() -> None:
    err = reason_of(b"1 2 3\n4 five 6\n", "xyz")
    assert err.reason == "bad-format" and "five" in str(err)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"OFF\n10 1 0\n0 0 0\n1 1 1\n", "truncated"),
        (b"OFF\n", "truncated"),
        (b"OFF\n3 x 0\n", "bad-format"),
        (b"OFF\n3\n", "bad-format"),
        (b"OFF\n2 0 0\n0 0\n1 1\n", "bad-shape"),
        (b"COFF\n2 0 0\n", "bad-format"),
    ],
)
def test_bad_off(data: bytes, reason: str) -> None:
    assert reason_of(data, "off").reason == reason


def test_off_huge_vertex_count() -> None:
    err = reason_of(b"OFF\n99999999999 0 0\n", "off")
    assert err.reason == "too-many-points" and "99999999999" in str(err)


def test_unknown_extension() -> None:
    err = reason_of(b"whatever", "stl")
    assert err.reason == "unknown-ext" and "'stl'" in str(err) and "npy" in str(err)


def test_check_points_dtype_and_type_errors() -> None:
    with pytest.raises(PointCloudFormatError) as info:
        check_points(np.zeros((3, 3), dtype=object))
    assert info.value.reason == "object-dtype"
    with pytest.raises(TypeError):
        check_points([[0, 0, 0], [1, 1, 1]])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        read_points("1 2 3", "xyz")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_max_points_is_a_config_error(bad: object) -> None:
    with pytest.raises(ValueError, match="max_points") as info:
        read_points(npy_bytes(XYZ), "npy", max_points=bad)  # type: ignore[arg-type]
    assert not isinstance(info.value, PointCloudFormatError)


def test_error_survives_pickling_for_worker_processes() -> None:
    err = reason_of(b"", "npy")
    clone = pickle.loads(pickle.dumps(err))
    assert clone.reason == err.reason and str(clone) == str(err)
