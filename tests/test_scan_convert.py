"""make_shards pointcloud --layout kitti|scans: scenes labelled per point, converted and checked.

The inputs are written here in the layouts other tools write: SemanticKITTI's velodyne .bin +
uint32 .label (instance ids in the high bits), a SemanticKITTI-style YAML learning map,
nuScenes-style .bin of 5 floats, CloudCompare's binary PLY (a float `scalar_Label`), ASCII PLY
and .npy tables with the label as a column.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from shardflow.convert import ConvertConfig, convert
from shardflow.errors import DataError
from shardflow.samples.scans import ScanOptions, with_learning_map
from shardflow.tools import make_shards

LEARNING_MAP = """\
labels:
  0: unlabeled
  10: car
  40: road
  50: building
learning_map:
  0: 0
  1: 0
  10: 1
  40: 2
  50: 3
learning_map_inv:
  0: 0
  1: 10
  2: 40
  3: 50
"""


def scene(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 (n, 4) points with remission, raw SemanticKITTI classes (n,))."""
    points = rng.uniform(-20, 20, (n, 4)).astype(np.float32)
    points[:, 3] = rng.uniform(0, 1, n)
    raw = rng.choice(np.array([0, 10, 40, 50], np.uint32), n)
    return points, raw


def write_kitti(root: Path, frames: int = 3, seed: int = 0) -> dict[str, tuple]:
    rng = np.random.default_rng(seed)
    written = {}
    for seq in ("00", "01"):
        (root / "sequences" / seq / "velodyne").mkdir(parents=True)
        (root / "sequences" / seq / "labels").mkdir(parents=True)
        for f in range(frames):
            points, raw = scene(rng, int(rng.integers(500, 1500)))
            instance = rng.integers(0, 5, len(raw)).astype(np.uint32) << 16
            points.tofile(root / "sequences" / seq / "velodyne" / f"{f:06d}.bin")
            (raw | instance).tofile(root / "sequences" / seq / "labels" / f"{f:06d}.label")
            written[f"{seq}_{f:06d}"] = (points, raw)
    (root / "semantic.yaml").write_text(LEARNING_MAP)
    return written


def members(out: Path) -> dict[str, dict[str, bytes]]:
    found: dict[str, dict[str, bytes]] = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, _, ext = m.name.partition(".")
                found.setdefault(key, {})[ext] = tar.extractfile(m).read()  # type: ignore[union-attr]
    return found


def load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def test_kitti_sequences_convert_with_the_learning_map(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # the progress bar: no thread
    written = write_kitti(tmp_path / "kitti")
    code = make_shards.main(["pointcloud", str(tmp_path / "kitti"), str(tmp_path / "out"),
                             "--layout", "kitti", "--learning-map",
                             str(tmp_path / "kitti" / "semantic.yaml"), "--workers", "2",
                             "--quiet"])
    assert code == 0
    stored = members(tmp_path / "out")
    assert sorted(stored) == sorted(written)
    mapping = {0: 0, 10: 1, 40: 2, 50: 3}
    for key, (points, raw) in written.items():
        np.testing.assert_array_equal(load(stored[key]["npy"]), points)  # remission kept
        labels = load(stored[key]["labels.npy"])
        assert labels.dtype == np.uint16
        np.testing.assert_array_equal(labels, [mapping[r] for r in raw])  # instance bits off
    seg = json.loads((tmp_path / "out" / "manifest.json").read_text())["segmentation"]
    assert seg["num_classes"] == 4 and seg["ignore_label"] == 0
    assert seg["class_names"] == ["unlabeled", "car", "road", "building"]
    all_raw = np.concatenate([raw for _, raw in written.values()])
    assert seg["label_counts"] == {str(mapping[r]): int((all_raw == r).sum())
                                   for r in (0, 10, 40, 50)}
    sizes = [len(raw) for _, raw in written.values()]
    assert seg["frames"] == 6 and seg["points"] == sum(sizes)
    assert seg["points_per_frame"]["min"] == min(sizes)


def test_nuscenes_bin_with_a_label_column_and_raw_labels(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    src = tmp_path / "scans"
    src.mkdir()
    table = rng.uniform(-5, 5, (300, 6)).astype(np.float32)  # x y z intensity ring label
    table[:, 5] = rng.integers(0, 17, 300)
    table.tofile(src / "frame.bin")
    manifest = convert(ConvertConfig(kind="pointcloud", src=str(src), out=str(tmp_path / "o"),
                                     workers=1, scan=ScanOptions("scans", point_dims=6,
                                                                 label_column="-1")))
    stored = members(tmp_path / "o")["frame"]
    np.testing.assert_array_equal(load(stored["npy"]), table[:, :5])
    np.testing.assert_array_equal(load(stored["labels.npy"]), table[:, 5])
    assert manifest.segmentation is not None
    assert manifest.segmentation["ignore_label"] is None
    assert manifest.segmentation["num_classes"] == int(table[:, 5].max()) + 1


def cloudcompare_ply(points: np.ndarray, labels: np.ndarray) -> bytes:
    """A binary PLY as CloudCompare saves a labelled cloud: doubles for x, y, z far from the
    origin (UTM), and the label as a float scalar field."""
    header = ("ply\nformat binary_little_endian 1.0\ncomment Created by CloudCompare v2.12\n"
              f"element vertex {len(points)}\nproperty double x\nproperty double y\n"
              "property double z\nproperty float scalar_Intensity\n"
              "property float scalar_Label\nend_header\n").encode()
    body = np.zeros(len(points), [("x", "<f8"), ("y", "<f8"), ("z", "<f8"),
                                  ("i", "<f4"), ("l", "<f4")])
    body["x"], body["y"], body["z"] = points.T
    body["i"], body["l"] = 0.5, labels
    return header + body.tobytes()


def test_cloudcompare_ply_far_from_the_origin_by_label_name(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    src = tmp_path / "scans"
    (src / "area1").mkdir(parents=True)
    utm = rng.uniform(0, 50, (400, 3)) + [630_000.0, 4_833_000.0, 80.0]
    labels = rng.integers(0, 8, 400)
    (src / "area1" / "tile.ply").write_bytes(cloudcompare_ply(utm, labels))
    convert(ConvertConfig(kind="pointcloud", src=str(src), out=str(tmp_path / "o"), workers=1,
                          scan=ScanOptions("scans", label_column="scalar_Label")))
    stored = members(tmp_path / "o")["area1_tile"]
    points, offset = load(stored["npy"]), load(stored["offset.npy"])
    assert points.shape == (400, 4)  # x, y, z, intensity: the label column is out
    np.testing.assert_allclose(points[:, :3] + offset, utm, atol=1e-3)  # float32 near 0
    np.testing.assert_array_equal(load(stored["labels.npy"]), labels)


def test_npy_table_by_label_index_and_ascii_ply(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    src = tmp_path / "scans"
    src.mkdir()
    table = np.column_stack([rng.uniform(-3, 3, (200, 3)), rng.integers(0, 8, 200)])
    np.save(src / "room.npy", table)
    rows = "\n".join(f"{x:.4f} {y:.4f} {z:.4f} {int(c)}" for x, y, z, c in table)
    (src / "room2.ply").write_text("ply\nformat ascii 1.0\nelement vertex 200\nproperty float x\n"
                                   "property float y\nproperty float z\nproperty uchar class\n"
                                   f"end_header\n{rows}\n")
    convert(ConvertConfig(kind="pointcloud", src=str(src), out=str(tmp_path / "o"), workers=1,
                          scan=ScanOptions("scans", label_column="3")))
    stored = members(tmp_path / "o")
    for key in ("room", "room2"):
        np.testing.assert_array_equal(load(stored[key]["labels.npy"]), table[:, 3])
        np.testing.assert_allclose(load(stored[key]["npy"]), table[:, :3], atol=1e-4)


def test_bad_scans_are_named_and_skipped(tmp_path: Path) -> None:
    written = write_kitti(tmp_path / "kitti", frames=2)
    seq = tmp_path / "kitti" / "sequences"
    (seq / "00" / "labels" / "000001.label").write_bytes(b"\0" * 40)  # too few labels
    points, raw = written["01_000000"]
    raw[3] = 99  # a raw class the learning map lacks
    raw.tofile(seq / "01" / "labels" / "000000.label")
    (seq / "01" / "labels" / "000001.label").unlink()
    bad = points.copy()
    bad[7, 1] = np.nan
    bad.tofile(seq / "00" / "velodyne" / "000000.bin")
    manifest = convert(ConvertConfig(
        kind="pointcloud", src=str(tmp_path / "kitti"), out=str(tmp_path / "o"), workers=1,
        on_error="skip", allow_empty=True,  # every scan is bad: refused without it
        scan=with_learning_map(ScanOptions("kitti"), seq.parent / "semantic.yaml")))
    assert manifest.total_samples == 0
    reasons = {e["key"]: e["reason"] for e in manifest.skipped}
    assert reasons == {"00_000000": "non-finite", "00_000001": "label-count",
                       "01_000000": "unknown-label", "01_000001": "missing-labels"}
    assert manifest.segmentation is not None and manifest.segmentation["frames"] == 0
    with pytest.raises(DataError, match="raw class 99"):
        convert(ConvertConfig(
            kind="pointcloud", src=str(seq / "01"), out=str(tmp_path / "o2"), workers=1,
            scan=with_learning_map(ScanOptions("kitti"), seq.parent / "semantic.yaml")))


def test_scan_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layout scans"):
        ScanOptions(label_column="label")
    (tmp_path / "map.yaml").write_text("labels: {0: a}\n")
    with pytest.raises(ValueError, match="not a learning map"):
        with_learning_map(ScanOptions("kitti"), tmp_path / "map.yaml")
    (tmp_path / "evil.yaml").write_text("learning_map: !!python/object/apply:os.system [ls]\n")
    with pytest.raises(ValueError, match="not a learning map"):
        with_learning_map(ScanOptions("kitti"), tmp_path / "evil.yaml")


def test_verify_checks_the_labels_member(tmp_path: Path) -> None:
    from shardflow.samples.checks import CheckLimits, check_member

    good = io.BytesIO()
    np.save(good, np.arange(10, dtype=np.uint16))
    check_member("labels.npy", good.getvalue(), CheckLimits(), None)
    for bad, reason in ((np.zeros((10, 3), np.float32), "bad-labels"),
                        (np.zeros(10, np.float32), "bad-labels")):
        out = io.BytesIO()
        np.save(out, bad)
        with pytest.raises(DataError) as err:
            check_member("labels.npy", out.getvalue(), CheckLimits(), None)
        assert err.value.reason == reason
    with pytest.raises(DataError) as err:
        check_member("labels.npy", good.getvalue()[:-4], CheckLimits(), None)
    assert err.value.reason == "truncated"


def test_kitti_keys_are_unique_and_name_the_sequence(tmp_path: Path) -> None:
    from shardflow.pointcloud.loader import pointcloud_loader

    write_kitti(tmp_path / "src" / "a", frames=2, seed=1)
    write_kitti(tmp_path / "src" / "b", frames=2, seed=2)  # the same sequence names again
    convert(ConvertConfig(kind="pointcloud", src=str(tmp_path / "src"), out=str(tmp_path / "o"),
                          workers=1, scan=ScanOptions("kitti")))
    keys = sorted(members(tmp_path / "o"))
    assert len(keys) == len(set(keys)) == 8 and all(k[:3] in ("00_", "01_") for k in keys)
    with pointcloud_loader(str(tmp_path / "o"), batch_size=3, train=False,
                           per_point_labels=True, backend="portable") as loader:
        assert sorted(k for b in loader for k in b.keys) == keys  # every frame loads
    one = tmp_path / "src" / "a" / "sequences" / "01"
    convert(ConvertConfig(kind="pointcloud", src=str(one), out=str(tmp_path / "o1"), workers=1,
                          scan=ScanOptions("kitti")))
    assert sorted(members(tmp_path / "o1")) == ["01_000000", "01_000001"]


def test_an_ignore_label_of_255_is_no_class(tmp_path: Path) -> None:
    src = tmp_path / "scans"
    src.mkdir()
    table = np.random.default_rng(4).uniform(-5, 5, (50, 4))
    table[:, 3] = [0, 1, 2, 255, 1] * 10
    np.save(src / "a.npy", table)
    manifest = convert(ConvertConfig(kind="pointcloud", src=str(src), out=str(tmp_path / "o"),
                                     workers=1, scan=ScanOptions("scans", label_column="3",
                                                                 ignore_label=255)))
    assert manifest.segmentation is not None
    assert manifest.segmentation["num_classes"] == 3
    (tmp_path / "map.yaml").write_text(
        "labels: {0: unlabeled, 10: car, 40: road}\nlearning_map: {0: 255, 10: 0, 40: 1}\n"
        "learning_map_inv: {255: 0, 0: 10, 1: 40}\n")
    opts = with_learning_map(ScanOptions("kitti"), tmp_path / "map.yaml")
    assert opts.num_classes == 2 and opts.ignore_label == 255  # the "unlabeled" class's
    assert opts.class_names == ("car", "road")
    (tmp_path / "map2.yaml").write_text(
        "labels: {0: unlabeled, 10: car, 40: road}\nlearning_map: {0: 0, 10: 1, 40: 2}\n"
        "learning_map_inv: {0: 0, 1: 10, 2: 40}\n")
    opts = with_learning_map(ScanOptions("kitti"), tmp_path / "map2.yaml")
    assert opts.ignore_label == 0 and opts.class_names == ("unlabeled", "car", "road")


@pytest.mark.parametrize("table", ["{-1: 2, 10: 1}", "{1.7: 3, 10: 1}", "{true: 4, 10: 1}",
                                   "{'10': 1, 10: 2}", "{10: 70000}", "{}"])
def test_learning_map_keys_are_whole_classes(tmp_path: Path, table: str) -> None:
    (tmp_path / "map.yaml").write_text(f"learning_map: {table}\n")
    with pytest.raises(ValueError, match="not a learning map"):
        with_learning_map(ScanOptions("kitti"), tmp_path / "map.yaml")


def test_options_a_layout_does_not_use_are_refused() -> None:
    with pytest.raises(ValueError, match="--ignore-label"):
        ScanOptions(ignore_label=0)
    assert ScanOptions(point_dims=5).point_dims == 5  # the width of a .bin in class folders
    with pytest.raises(ValueError, match="its .label files"):
        ScanOptions("kitti", label_column="3")


def test_resharding_scans_keeps_the_segmentation_section(tmp_path: Path) -> None:
    written = write_kitti(tmp_path / "kitti", frames=2)
    scan = with_learning_map(ScanOptions("kitti"), tmp_path / "kitti" / "semantic.yaml")
    first = convert(ConvertConfig(kind="pointcloud", src=str(tmp_path / "kitti"),
                                  out=str(tmp_path / "a"), workers=1, scan=scan))
    again = convert(ConvertConfig(kind="shards", src=str(tmp_path / "a"),
                                  out=str(tmp_path / "b"), workers=1, max_count=1))
    assert again.total_samples == len(written) and len(again.shards) == len(written)
    assert again.segmentation == first.segmentation
