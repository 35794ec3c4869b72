"""pointcloud_loader(per_point_labels=True): LiDAR scenes in ragged batches, labels aligned
through every augmentation, voxel labels and the projection back checked against numpy."""

from __future__ import annotations

import io
import math
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import copier_outputs, not_delivered

from shardflow.convert import ConvertConfig, convert
from shardflow.errors import DataError
from shardflow.pointcloud import segvoxels
from shardflow.pointcloud.config import PointCloudConfig
from shardflow.pointcloud.loader import pointcloud_loader
from shardflow.pointcloud.sample import scene_params
from shardflow.samples.scans import ScanOptions

GROUND, OBJECT, IGNORE = 1, 2, 0
BACKENDS = ["portable", "dali"]


def street(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A scene whose labels follow from its geometry: ground points at z in [-0.05, 0.05]
    labelled 1, object points at z in [1, 3] labelled 2, a few unlabelled (0) among both."""
    points = np.zeros((n, 4), np.float32)
    points[:, :2] = rng.uniform(-30, 30, (n, 2))
    ground = rng.random(n) < 0.6
    points[:, 2] = np.where(ground, rng.uniform(-0.05, 0.05, n), rng.uniform(1, 3, n))
    points[:, 3] = rng.random(n)
    labels = np.where(ground, GROUND, OBJECT).astype(np.uint32)
    labels[rng.random(n) < 0.02] = IGNORE
    return points, labels


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple]]:
    root = tmp_path_factory.mktemp("scenes")
    rng = np.random.default_rng(0)
    written = {}
    for f in range(6):
        points, labels = street(rng, int(rng.integers(2000, 5000)))
        stem = root / "raw" / f"frame{f}"
        stem.parent.mkdir(exist_ok=True)
        points.tofile(f"{stem}.bin")
        labels.tofile(f"{stem}.label")
        written[f"frame{f}"] = (points, labels)
    convert(ConvertConfig(kind="pointcloud", src=str(root / "raw"), out=str(root / "shards"),
                          max_count=2, workers=1,
                          scan=ScanOptions("scans", ignore_label=IGNORE)))
    return root / "shards", written


def frames(batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    o = batch.offsets.tolist()
    return {k: (batch.points[o[i]:o[i + 1]], batch.labels[o[i]:o[i + 1]])
            for i, k in enumerate(batch.keys)}


def every(loader) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for batch in loader:
        out.update(frames(batch))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_evaluation_gives_every_point_with_its_label(scenes, backend: str) -> None:
    shards, written = scenes
    with pointcloud_loader(str(shards), batch_size=4, train=False, per_point_labels=True,
                           backend=backend) as loader:
        assert loader.num_classes == 3 and loader.ignore_label == IGNORE
        got = every(loader)
    assert sorted(got) == sorted(written)
    for key, (points, labels) in written.items():
        np.testing.assert_array_equal(got[key][0].numpy(), points[:, :3])  # metres, as stored
        np.testing.assert_array_equal(got[key][1].numpy(), labels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_labels_stay_aligned_through_every_augmentation(scenes, backend: str) -> None:
    """A label computed from the geometry still holds after augmenting: ground is within
    0.4 m of the frame's lowest point, objects above (scale 0.9-1.1, so 1 m -> >= 0.9 m),
    and each point is where the drawn parameters put it."""
    shards, written = scenes
    options = dict(per_point_labels=True, backend=backend, rotate=180, scale=(0.9, 1.1),
                   flip=True, translate=2.0, jitter=0.01, crop_box=(30.0, 30.0),
                   frame_points=1500, seed=3)
    with pointcloud_loader(str(shards), batch_size=3, **options) as loader:
        got = every(loader)
    spec = PointCloudConfig(batch_size=3, **options).augment_spec()  # type: ignore[arg-type]
    for key, (points, labels) in got.items():
        source, source_labels = written[key]
        assert 0 < len(points) <= 1500
        labelled = labels != IGNORE
        height = points[:, 2] - points[:, 2].min()
        assert ((height < 0.4) == (labels == GROUND))[labelled].all()
        params = scene_params(spec, len(source), key, 0)
        expected, expected_labels = replay(source, source_labels, params)
        np.testing.assert_allclose(points.numpy(), expected, atol=1e-3)
        np.testing.assert_array_equal(labels.numpy(), expected_labels)


def replay(points: np.ndarray, labels: np.ndarray, params) -> tuple[np.ndarray, np.ndarray]:
    """The augmentation in plain numpy, float64: R(angle) S x + shift + noise, then the box."""
    a = math.radians(params.angle)
    rotation = np.array([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0],
                         [0, 0, 1]])
    xyz = points[params.index, :3].astype(np.float64) * params.scales()
    out = xyz @ rotation.T + params.shift + params.noise
    kept = labels[params.index]
    centre = out[params.centre, :2]
    inside = (np.abs(out[:, :2] - centre) <= 15.0).all(axis=1)
    return out[inside], kept[inside]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_training_epoch_draws_again_and_resumes_exactly(scenes, backend: str) -> None:
    shards, _ = scenes
    options = dict(batch_size=2, per_point_labels=True, backend=backend, flip=True,
                   translate=1.0, voxel_size=0.5)
    with pointcloud_loader(str(shards), **options) as loader:
        first = next(iter(loader))
        state = loader.state_dict()
        rest = list(loader)
    with pointcloud_loader(str(shards), **options) as again:
        again.load_state_dict(state)
        resumed = list(again)
    assert len(first) == 2 and [b.keys for b in resumed] == [b.keys for b in rest]
    for a, b in zip(rest, resumed, strict=True):
        assert torch.equal(a.points, b.points) and torch.equal(a.voxel_labels, b.voxel_labels)


def test_ranks_split_the_scenes(scenes) -> None:
    shards, written = scenes
    seen = []
    for rank in (0, 1):
        with pointcloud_loader(str(shards), batch_size=2, train=False, per_point_labels=True,
                               backend="portable", rank=rank, world_size=2) as loader:
            seen.append(set(every(loader)))
    # 3 shards over 2 ranks: each reads 2 scenes, the rest is left out (and logged) so that
    # both run the same number of batches
    assert not seen[0] & seen[1] and len(seen[0]) == len(seen[1]) == 2
    assert seen[0] | seen[1] <= set(written)


def reference_voxels(points: np.ndarray, frame: np.ndarray, labels: np.ndarray,
                     grid: segvoxels.VoxelGrid, ignore: int) -> dict[tuple, tuple[int, int]]:
    """{(frame, ix, iy, iz): (points, majority label)} point by point, in plain Python."""
    low, size, dims = np.array(grid.point_range[:3]), np.array(grid.size), grid.dims
    votes: dict[tuple, Counter] = {}
    totals: Counter = Counter()
    for p, f, lab in zip(points.astype(np.float64), frame, labels, strict=True):
        if not np.isfinite(p).all():
            continue
        cell = tuple(int(c) for c in np.floor((p - low) / size))
        if not all(0 <= c < d for c, d in zip(cell, dims, strict=True)):
            continue
        key = (int(f), *cell)
        totals[key] += 1
        votes.setdefault(key, Counter())
        if lab != ignore:
            votes[key][int(lab)] += 1
    out = {}
    for key, n in totals.items():
        ranked = sorted(votes[key].items(), key=lambda kv: (-kv[1], kv[0]))
        out[key] = (n, ranked[0][0] if ranked else ignore)
    return out


def test_voxel_labels_and_projection_match_a_numpy_reference() -> None:
    rng = np.random.default_rng(5)
    points = rng.uniform(-3, 3, (4000, 3)).astype(np.float32)
    points[:5] = [[np.nan, 0, 0], [10, 0, 0], [0, 0, 2.0], [-2.0, -2.0, -1.0], [0, 0, 0]]
    frame = np.repeat([0, 1, 2], [1500, 1500, 1000])
    labels = rng.integers(0, 4, 4000)  # 0 is ignore: some voxels hold only ignored points
    grid = segvoxels.VoxelGrid((0.5, 0.5, 0.75), (-2.0, -2.0, -1.0, 2.0, 2.0, 2.0))
    rows = segvoxels.voxel_rows(torch.from_numpy(points), torch.from_numpy(frame),
                                torch.from_numpy(labels), grid, ignore_label=0)
    expected = reference_voxels(points, frame, labels, grid, ignore=0)
    coords = [tuple(c) for c in rows.coords.tolist()]
    assert sorted(coords) == coords and set(coords) == set(expected)
    assert [(n, lab) for n, lab in zip(rows.counts.tolist(), rows.labels.tolist(),
                                       strict=True)] == [expected[c] for c in coords]
    assert 0 in rows.labels.tolist()  # a voxel of ignored points only
    # each point's voxel holds it; outside points (NaN, beyond, the upper face) get -1
    pv = rows.point_voxel.numpy()
    assert (pv[:3] == -1).all() and pv[3] >= 0
    cells = np.floor((points[pv >= 0] - [-2.0, -2.0, -1.0]) / [0.5, 0.5, 0.75])
    np.testing.assert_array_equal(rows.coords.numpy()[pv[pv >= 0]],
                                  np.column_stack([frame[pv >= 0], cells]))
    logits = torch.randn(len(coords), 4)
    assert torch.equal(logits[rows.point_voxel[pv >= 0]][10], logits[pv[pv >= 0][10]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_carry_the_voxels_of_their_points(scenes, backend: str) -> None:
    shards, _ = scenes
    with pointcloud_loader(str(shards), batch_size=3, train=False, per_point_labels=True,
                           backend=backend, voxel_size=(1.0, 1.0, 0.5),
                           point_range=(-20, -20, -1, 20, 20, 3)) as loader:
        batch = next(iter(loader))
    assert batch.grid == (40, 40, 8)
    frame = np.repeat(np.arange(3), np.diff(batch.offsets.numpy()))
    expected = reference_voxels(batch.points.numpy(), frame, batch.labels.numpy(),
                                segvoxels.VoxelGrid((1.0, 1.0, 0.5), (-20, -20, -1, 20, 20, 3)),
                                IGNORE)
    assert [tuple(c) for c in batch.voxel_coords.tolist()] == sorted(expected)
    assert batch.voxel_labels.tolist() == [expected[c][1] for c in sorted(expected)]
    outside = (batch.points[:, :2].abs() >= 20).any(dim=1)
    assert torch.equal(batch.point_voxel < 0, outside)


def write_shard(path: Path, samples: list[dict[str, bytes]]) -> None:
    """A shard as webdataset's own TarWriter writes it."""
    import webdataset as wds

    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_scenes_are_named_and_skipped(tmp_path: Path, backend: str) -> None:
    rng = np.random.default_rng(1)
    good = rng.uniform(-5, 5, (100, 3)).astype(np.float32)
    labels = rng.integers(0, 3, 100).astype(np.uint16)
    nan = good.copy()
    nan[4, 2] = np.nan
    write_shard(tmp_path / "s-000000.tar", [
        {"__key__": "good", "npy": npy(good), "labels.npy": npy(labels)},
        {"__key__": "short", "npy": npy(good), "labels.npy": npy(labels[:90])},
        {"__key__": "nolabels", "npy": npy(good)},
        {"__key__": "range", "npy": npy(good), "labels.npy": npy(labels + 7)},
        {"__key__": "nan", "npy": npy(nan), "labels.npy": npy(labels)},
        {"__key__": "float", "npy": npy(good), "labels.npy": npy(labels.astype(np.float32))},
    ])
    with pointcloud_loader(str(tmp_path / "s-000000.tar"), batch_size=8, train=False,
                           per_point_labels=True, backend=backend, num_classes=3,
                           on_error="skip") as loader:
        batches = list(loader)
        reasons = {s["key"]: s["reason"] for s in loader.skipped}
    assert [b.keys for b in batches] == [["good"]]
    assert reasons == {"short": "label-count", "nolabels": "missing-labels",
                       "range": "bad-label", "nan": "non-finite", "float": "bad-labels"}
    with pointcloud_loader(str(tmp_path / "s-000000.tar"), batch_size=8, train=False,
                           per_point_labels=True, backend=backend,
                           num_classes=3) as loader, \
            pytest.raises(DataError, match=r"s-000000.tar key '\w+': .*label"):
        list(loader)


def test_scene_options_are_checked(scenes, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="per_point_labels"):
        PointCloudConfig(batch_size=2, flip=True)
    with pytest.raises(ValueError, match="keeps its metres"):
        PointCloudConfig(batch_size=2, per_point_labels=True, normalize=True)
    with pytest.raises(ValueError, match="point_range"):
        PointCloudConfig(batch_size=2, per_point_labels=True, voxel_size=0.5,
                         point_range=(0, 0, 0, -1, 1, 1))
    from shardflow.builtin import make_pointcloud_folder

    folder = make_pointcloud_folder(tmp_path / "objects", per_class=2, points=64)
    convert(ConvertConfig(kind="pointcloud", src=str(folder), out=str(tmp_path / "o"),
                          workers=1))
    with pytest.raises(ValueError, match="label each"):
        pointcloud_loader(str(tmp_path / "o"), batch_size=2, per_point_labels=True)


def test_scenes_mix_by_batch_and_refuse_mixing_per_sample(scenes) -> None:
    """Two sources (one shard; the other two): epoch_batches batches of batch_size scenes,
    each batch whole from one source, each scene every point with its label."""
    shards, written = scenes
    mixture = [(str(shards / "train-000000.tar"), 0.5),
               (str(shards / "train-{000001..000002}.tar"), 0.5)]
    holds = []  # each source's keys, read from its tars
    for pattern in ("train-000000.tar", "train-00000[12].tar"):
        keys = set()
        for path in shards.glob(pattern):
            with tarfile.open(path) as tar:
                keys |= {m.name.split(".", 1)[0] for m in tar}
        holds.append(keys)
    assert sorted(len(k) for k in holds) == [2, 4] and holds[0] | holds[1] == set(written)
    with pointcloud_loader(mixture, batch_size=2, per_point_labels=True, backend="portable",
                           mixing="batch", epoch_batches=3) as loader:
        batches = list(loader)
        counts = list(loader.last_counts.values())
    assert [len(b.keys) for b in batches] == [2, 2, 2]
    source = [next((i for i, keys in enumerate(holds) if set(b.keys) <= keys), None)
              for b in batches]
    assert None not in source and counts == [2 * source.count(i) for i in (0, 1)]
    for b in batches:
        for key, (points, labels) in frames(b).items():
            assert len(points) == len(written[key][0])
            assert np.array_equal(np.bincount(labels.numpy(), minlength=3),
                                  np.bincount(written[key][1], minlength=3))
    with pointcloud_loader(mixture, batch_size=2, per_point_labels=True, backend="portable",
                           epoch_batches=3) as loader, \
            pytest.raises(ValueError, match="mixing='batch'"):
        list(loader)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,decode", [("portable", "cpu"), ("dali", "cpu"),
                                            ("dali", "gpu")])
def test_scenes_on_cuda_equal_the_cpu_batches(scenes, backend: str, decode: str) -> None:
    """A GPU loader's ragged batches (DALI's padded output cut on the device for
    decode="gpu") and voxel rows against the CPU loader's."""
    shards, _ = scenes
    options = dict(batch_size=3, train=False, per_point_labels=True, voxel_size=0.5,
                   backend=backend)
    with pointcloud_loader(str(shards), device="cpu", **options) as host, \
            pointcloud_loader(str(shards), device="cuda", decode=decode, **options) as dev:
        pairs = list(zip(host, dev, strict=True))
    for a, b in pairs:
        assert b.points.is_cuda and b.point_voxel.is_cuda
        torch.testing.assert_close(b.points.cpu(), a.points, atol=1e-5, rtol=0)
        for name in ("offsets", "labels", "voxel_coords", "voxel_labels", "point_voxel"):
            assert torch.equal(getattr(b, name).cpu(), getattr(a, name)), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_tensor_of_a_scene_batch_comes_out_of_the_copier(scenes, monkeypatch, backend):
    """The CPU twin of the test above (for decode="cpu"): the ragged batch and its voxel rows
    are all moved by the copier, so on a GPU every field lands there."""
    shards, _ = scenes
    outputs = copier_outputs(monkeypatch)
    with pointcloud_loader(str(shards), batch_size=3, train=False, per_point_labels=True,
                           voxel_size=0.5, backend=backend, device="cpu") as loader:
        batches = list(loader)
    names = ("points", "offsets", "labels", "voxel_coords", "voxel_labels", "point_voxel")
    assert batches and all(isinstance(getattr(b, n), torch.Tensor) for b in batches
                           for n in names)
    assert [not_delivered(b, outputs) for b in batches] == [[]] * len(batches)


def test_a_labels_header_declaring_too_much_is_a_skip_not_an_allocation(tmp_path: Path
                                                                        ) -> None:
    points = np.random.default_rng(2).uniform(-5, 5, (20, 3)).astype(np.float32)
    huge = npy(np.zeros(20, np.uint16)).replace(b"(20,)", b"(100000000000000,)")
    negative = npy(np.full(20, -3, np.int64))
    write_shard(tmp_path / "s-000000.tar", [
        {"__key__": "huge", "npy": npy(points), "labels.npy": huge},
        {"__key__": "negative", "npy": npy(points), "labels.npy": negative},
        {"__key__": "good", "npy": npy(points), "labels.npy": npy(np.ones(20, np.uint8))}])
    with pointcloud_loader(str(tmp_path / "s-000000.tar"), batch_size=4, train=False,
                           per_point_labels=True, backend="portable", on_error="skip",
                           voxel_size=1.0) as loader:
        assert [b.keys for b in loader] == [["good"]]
        reasons = {s["key"]: s["reason"] for s in loader.skipped}
    assert reasons == {"huge": "truncated", "negative": "bad-label"}  # no classes known here


def test_crops_keep_points_within_range_and_never_empty_a_scene(scenes) -> None:
    shards, _ = scenes
    with pointcloud_loader(str(shards), batch_size=3, per_point_labels=True,
                           backend="portable", rotate=0, scale=(1, 1), jitter=0,
                           crop_range=12.0) as loader:
        for batch in loader:
            radius = batch.points[:, :2].norm(dim=1)
            assert (radius <= 12.0 + 1e-4).all() and len(batch.points)
    with pointcloud_loader(str(shards), batch_size=3, per_point_labels=True,
                           backend="portable", crop_range=3.0, crop_box=(0.5, 0.5)) as loader:
        for batch in loader:
            assert (torch.diff(batch.offsets) > 0).all()  # a box about an in-range point


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("box", [None, (2.0, 2.0)])
def test_a_frame_with_no_point_in_crop_range_is_a_counted_skip(tmp_path: Path, backend: str,
                                                               box: tuple | None) -> None:
    """A frame far from the sensor keeps no point through crop_range: it is named and counted
    (read + skipped == total), or raised naming shard and key, never a scene of 0 points."""
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 3, 200).astype(np.uint16)
    write_shard(tmp_path / "s-000000.tar", [
        {"__key__": "near", "npy": npy(rng.uniform(-4, 4, (200, 3)).astype(np.float32)),
         "labels.npy": npy(labels)},
        {"__key__": "far", "npy": npy(rng.uniform(20, 30, (200, 3)).astype(np.float32)),
         "labels.npy": npy(labels)}])
    options = dict(batch_size=2, per_point_labels=True, backend=backend, num_classes=3,
                   crop_range=5.0, crop_box=box, rotate=0, scale=(1, 1), jitter=0,
                   voxel_size=0.5)
    with pointcloud_loader(str(tmp_path / "s-000000.tar"), on_error="skip",
                           **options) as loader:
        batches = list(loader)
        assert [s["reason"] for s in loader.skipped] == ["empty-after-crop"]
        assert loader.skipped[0]["key"] == "far" and loader.skipped_samples() == 1
    assert [b.keys for b in batches] == [["near"]]
    assert (torch.diff(batches[0].offsets) > 0).all() and len(batches[0].voxel_coords)
    with pointcloud_loader(str(tmp_path / "s-000000.tar"), **options) as loader, \
            pytest.raises(DataError, match=r"s-000000.tar key 'far': .*crop_range"):
        list(loader)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_geographic_float64_scene_from_another_tool_keeps_its_precision(tmp_path: Path,
                                                                         backend: str) -> None:
    """A float64 scene about 5e6 m from the origin in a TarWriter shard: points relative to
    the offset the loader takes, batch.offset that offset, labels in step."""
    rng = np.random.default_rng(4)
    truth = rng.uniform(-20, 20, (300, 3)) + np.array([5_123_456.0, 4_987_654.0, 120.0])
    labels = rng.integers(0, 3, 300).astype(np.uint16)
    write_shard(tmp_path / "s-000000.tar", [
        {"__key__": "geo", "npy": npy(truth), "labels.npy": npy(labels)}])
    with pointcloud_loader(str(tmp_path / "s-000000.tar"), batch_size=1, train=False,
                           per_point_labels=True, backend=backend, num_classes=3) as loader:
        (batch,) = list(loader)
    got = batch.points.double().numpy() + batch.offset[0].numpy()
    assert batch.offset[0].abs().max() > 1e5 and batch.labels.tolist() == labels.tolist()
    assert np.abs(got - truth).max() <= 1e-6 * np.ptp(truth, axis=0).max()
