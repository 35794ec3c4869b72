"""A conversion that converts nothing fails, naming what it passed over; KITTI `.bin` scans
convert without labels (`--layout scans`) and, in class folders, labelled by folder.

The scans are written as KITTI's velodyne files are: float32 x, y, z, remission, N x 4, by
numpy's own `tofile`, by the standard library's `array` (as a C program's fwrite) and by
`struct` point by point. The reference for every value read back is numpy's
`np.fromfile(path, np.float32).reshape(-1, 4)`, never our reader. The CLI runs as a user runs
it: `python -m shardflow convert ...` in a subprocess.
"""

from __future__ import annotations

import array
import io
import json
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from shardflow.errors import DataError


def shardflow(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardflow", "convert", *map(str, args),
                           "--workers", "1", "--quiet"], capture_output=True, text=True,
                          timeout=300)


def kitti_scan(path: Path, n: int, seed: int, writer: str = "numpy") -> None:
    """A KITTI velodyne scan of n points: x, y, z in metres, remission in [0, 1]."""
    rng = np.random.default_rng(seed)
    points = np.column_stack([rng.uniform(-40, 40, (n, 2)), rng.uniform(-2, 1, n),
                              rng.uniform(0, 1, n)]).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    if writer == "numpy":
        points.tofile(path)
    elif writer == "array":  # a C program's fwrite of a float buffer
        buf = array.array("f", points.ravel().tolist())
        if sys.byteorder == "big":
            buf.byteswap()  # KITTI's files are little-endian
        path.write_bytes(buf.tobytes())
    else:  # struct, point by point
        path.write_bytes(b"".join(struct.pack("<4f", *row) for row in points.tolist()))


def reference(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.float32).reshape(-1, 4)


def members(out: Path) -> dict[str, dict[str, bytes]]:
    """Every sample's members, read from the tars with tarfile."""
    found: dict[str, dict[str, bytes]] = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, _, ext = m.name.partition(".")
                found.setdefault(key, {})[ext] = tar.extractfile(m).read()  # type: ignore[union-attr]
    return found


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def class_folders_of_bin(root: Path) -> dict[str, Path]:
    """The reported layout: KITTI scans in one folder per class; {key: file}."""
    files = {}
    for c, cls in enumerate(("car", "tree")):
        for i in range(3):
            path = root / cls / f"{i:06d}.bin"
            kitti_scan(path, 50 + 7 * i + c, seed=10 * c + i, writer=("numpy", "array",
                                                                          "struct")[i])
            files[f"{cls}_{i:06d}"] = path
    return files


# -- nothing converted ---------------------------------------------------------------------------

def test_bin_scans_in_class_folders_as_images_exit_2_naming_the_kind_that_takes_them(
        tmp_path: Path) -> None:
    class_folders_of_bin(tmp_path / "src")
    proc = shardflow("imagefolder", tmp_path / "src", tmp_path / "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "nothing converted: 0 samples (imagefolder)" in err
    assert "passed over 6 files that are not inputs of this kind" in err
    assert "not-a-class-image=6 (car/000000.bin, car/000001.bin, car/000002.bin, ...)" in err
    assert "6 .bin files: convert them with `pointcloud`" in err and "--layout scans" in err
    assert "--allow-empty" in err
    assert not (tmp_path / "out" / "manifest.json").exists()  # nothing marks OUT finished
    allowed = shardflow("imagefolder", tmp_path / "src", tmp_path / "out", "--allow-empty")
    assert allowed.returncode == 0, allowed.stderr
    assert manifest(tmp_path / "out")["total_samples"] == 0


@pytest.mark.parametrize("kind, write, args, says", [
    ("text", {"a.csv": b"x,y\n1,2\n", "b.bin": b"\0" * 16}, (),
     ["not-a-text-file=2 (a.csv, b.bin)", "1 .csv files: convert them with `tabular`",
      "1 .bin files: convert them with `pointcloud`"]),
    ("pointcloud", {"c/bad.npy": b"not a npy", "c/cut.bin": b"\0" * 15}, ("--on-error", "skip"),
     ["skipped 2 bad inputs: ", "(c/bad.npy)", "(c/cut.bin)"]),
    ("pointcloud", {"000000.bin": b"\0" * 32, "000001.bin": b"\0" * 32}, (),  # no class folder
     ["not-a-class-pointcloud=2 (000000.bin, 000001.bin)", "2 files lie directly under SRC",
      "`--layout scans`"]),
    ("tabular", {"t.csv": b"click,a\n"}, ("--label-column", "click", "--dense-columns", "a"),
     ["its inputs hold no sample"]),
    ("pointcloud", {"c/one.bin": b"\0" * 16 + b"\x00\x00\x80\x3f" * 4}, ("--part", "0/2"),
     ["(pointcloud --layout classes --part 0/2)", "with fewer inputs than parts"]),
])
def test_every_kind_that_converts_nothing_exits_2_and_says_why(
        tmp_path: Path, kind: str, write: dict[str, bytes], args: tuple[str, ...],
        says: list[str]) -> None:
    for name, data in write.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_bytes(data)
    proc = shardflow(kind, tmp_path / "src", tmp_path / "out", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "nothing converted: 0 samples" in proc.stderr
    for text in says:
        assert text in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_parquet_file_of_no_rows_exits_2(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "src" / "e.parquet")
    proc = shardflow("parquet", tmp_path / "src", tmp_path / "out", "--text-column", "text")
    assert proc.returncode == 2 and "nothing converted: 0 samples (parquet)" in proc.stderr


def test_overwrite_keeps_the_old_shards_when_the_new_source_has_nothing(tmp_path: Path) -> None:
    files = class_folders_of_bin(tmp_path / "src")
    assert shardflow("pointcloud", tmp_path / "src", tmp_path / "out").returncode == 0
    proc = shardflow("imagefolder", tmp_path / "src", tmp_path / "out", "--overwrite")
    assert proc.returncode == 2 and "nothing converted" in proc.stderr
    assert manifest(tmp_path / "out")["total_samples"] == len(files)  # refused before cleaning


# -- KITTI scans ---------------------------------------------------------------------------------

def test_bin_scans_in_class_folders_convert_labelled_by_folder(tmp_path: Path) -> None:
    files = class_folders_of_bin(tmp_path / "src")
    proc = shardflow("pointcloud", tmp_path / "src", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert f"{len(files)} samples" in proc.stdout
    m = manifest(tmp_path / "out")
    assert m["classes"] == {"car": 0, "tree": 1} and m["ignored"] == []
    got = members(tmp_path / "out")
    assert sorted(got) == sorted(files)
    for key, path in files.items():
        assert got[key]["cls"] == str(m["classes"][key.split("_")[0]]).encode()
        stored = np.load(io.BytesIO(got[key]["npy"]), allow_pickle=False)
        assert stored.dtype == np.float32
        np.testing.assert_array_equal(stored, reference(path))


@pytest.mark.parametrize("backend", ["dali", "portable"])
def test_unlabelled_kitti_scans_convert_under_layout_scans(tmp_path: Path, backend: str
                                                           ) -> None:
    from shardflow import pointcloud_loader

    files = {}
    for seq in ("00", "01"):
        for i, writer in enumerate(("numpy", "array", "struct")):
            path = tmp_path / "src" / seq / "velodyne" / f"{i:06d}.bin"
            kitti_scan(path, 120 + 13 * i + int(seq), seed=i + 5 * int(seq), writer=writer)
            files[f"{seq}_velodyne_{i:06d}"] = path
    proc = shardflow("pointcloud", "--layout", "scans", tmp_path / "src", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert f"1 shards, {len(files)} samples" in proc.stdout and "no labels" in proc.stdout
    m = manifest(tmp_path / "out")
    assert m["total_samples"] == len(files) and m["modality"] == "pointcloud"
    assert not m.get("classes") and not m.get("segmentation") and not m.get("labels")
    got = members(tmp_path / "out")
    assert sorted(got) == sorted(files)
    for key, path in files.items():
        assert set(got[key]) == {"npy"}  # no label of any kind made up
        np.testing.assert_array_equal(np.load(io.BytesIO(got[key]["npy"])), reference(path))

    most = max(len(reference(p)) for p in files.values())
    read = {}
    with pointcloud_loader(tmp_path / "out", batch_size=4, train=False, normalize=False,
                           num_points=most, labels=False, device="cpu", backend=backend,
                           threads=1) as loader:
        for batch in loader:
            assert batch.label is None
            read.update({k: batch.points[i].numpy() for i, k in enumerate(batch.keys)})
    assert sorted(read) == sorted(files)
    for key, path in files.items():
        ref = reference(path)
        np.testing.assert_array_equal(read[key][:len(ref)], ref[:, :3])  # x, y, z as written

    with pytest.raises(DataError, match="pass labels=False"):
        with pointcloud_loader(tmp_path / "out", batch_size=4, num_points=16, device="cpu",
                               backend=backend, threads=1) as loader:
            next(iter(loader))


def test_label_options_without_labels_are_refused_and_missing_labels_still_fail(
        tmp_path: Path) -> None:
    kitti_scan(tmp_path / "src" / "000000.bin", 40, seed=1)
    (tmp_path / "map.yaml").write_text("learning_map:\n  0: 0\n  10: 1\n")
    proc = shardflow("pointcloud", "--layout", "scans", tmp_path / "src", tmp_path / "out",
                     "--learning-map", tmp_path / "map.yaml")
    assert proc.returncode == 2
    assert "--learning-map maps labels, but no scan has any" in proc.stderr
    # one scan labelled, one not: a forgotten .label file is an error, never unlabelled data
    kitti_scan(tmp_path / "src" / "000001.bin", 30, seed=2)
    np.zeros(30, np.uint32).tofile(tmp_path / "src" / "000001.label")
    proc = shardflow("pointcloud", "--layout", "scans", tmp_path / "src", tmp_path / "o2")
    assert proc.returncode == 1 and "[missing-labels]" in proc.stderr
