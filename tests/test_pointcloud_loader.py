"""The point-cloud loader on real shards through DALI in CPU mode: values against a numpy
reference, augmentation fixed per key, resume, ranks, voxels, bad clouds, and training."""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from badfiles import bad_samples, good, npy
from conftest import read_wds, run_tool

from shardflow.builtin import make_pointcloud_folder
from shardflow.convert import ConvertConfig, convert
from shardflow.errors import DataError
from shardflow.loading.shardlist import resolve_source
from shardflow.pointcloud import sample as pointcloud_sample
from shardflow.pointcloud.loader import PointCloudConfig, PointCloudLoader, pointcloud_loader
from shardflow.pointcloud.sample import sample_params
from shardflow.pointcloud.voxelize import voxelize
from shardflow.shards.writer import ShardWriter
from shardflow.tools.bench.pointcloud import augment_numpy

OPTS = {"device": "cpu", "threads": 1, "shuffle_buffer": 16}
POINTS = 96  # per stored cloud


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """36 clouds of 96 points in 6 classes, 8 per shard (5 shards, the last one short)."""
    root = tmp_path_factory.mktemp("pcshards")
    src = make_pointcloud_folder(root / "src", per_class=6, points=POINTS)
    convert(ConvertConfig(kind="pointcloud", src=str(src), out=root / "out", max_count=8,
                          workers=1))
    return root / "out"


@pytest.fixture(scope="module")
def clouds(shards: Path) -> dict[str, tuple[np.ndarray, int]]:
    """Every stored cloud and label by key, read with the webdataset library."""
    return {s["__key__"]: (np.load(io.BytesIO(s["npy"]), allow_pickle=False), int(s["cls"]))
            for s in read_wds(shards)}


def epoch(loader) -> list:
    return list(loader)


def by_key(batches) -> dict[str, torch.Tensor]:
    return {k: b.points[i] for b in batches for i, k in enumerate(b.keys)}


# -- values ------------------------------------------------------------------------------------

def test_eval_round_trip_gives_each_cloud_normalized_with_its_label(shards, clouds):
    with pointcloud_loader(shards, batch_size=10, train=False, num_points=POINTS,
                           **OPTS) as loader:
        assert len(loader) == 4  # DALI's reader for local indexed shards; portable streams
        assert loader.reader == ("dali" if loader.backend == "dali" else "stream")
        batches = epoch(loader)
    assert [tuple(b.points.shape) for b in batches] == [(10, POINTS, 3)] * 3 + [(6, POINTS, 3)]
    assert batches[0].points.dtype == torch.float32 and batches[0].voxels is None
    keys = [k for b in batches for k in b.keys]
    assert sorted(keys) == sorted(clouds)  # eval: every cloud once
    for b in batches:
        assert b.label.tolist() == [clouds[k][1] for k in b.keys]
        for i, key in enumerate(b.keys):
            cloud = clouds[key][0]
            centre = (cloud.max(0) + cloud.min(0)) / 2
            expected = (cloud - centre) / np.linalg.norm(cloud - centre, axis=1).max()
            np.testing.assert_allclose(b.points[i].numpy(), expected, atol=1e-5)
            assert abs(float(b.points[i].norm(dim=1).max()) - 1) < 1e-5


@pytest.mark.parametrize("num_points", [64, 128])  # sampled down, and padded by repeats
@pytest.mark.parametrize("train", [True, False])
def test_points_equal_the_numpy_reference_of_the_same_parameters(shards, clouds, num_points,
                                                                 train):
    cfg = PointCloudConfig(batch_size=8, train=train, seed=5, num_points=num_points,
                           rotate=90.0, scale=(0.5, 1.5), jitter=0.02, **OPTS)
    loader = PointCloudLoader(resolve_source(shards), cfg, 0, 1)
    loader.set_epoch(2)
    got = by_key(epoch(loader))
    assert len(got) == len(clouds)
    for key, points in got.items():
        expected = augment_numpy(clouds[key][0], sample_params(cfg, POINTS, key, 2), True)
        np.testing.assert_allclose(points.numpy(), expected, atol=1e-5)
    if train:  # the augmentation did something: these are not the plain normalized clouds
        plain = PointCloudConfig(batch_size=8, train=False, num_points=num_points)
        for key, points in got.items():
            unmoved = augment_numpy(clouds[key][0], sample_params(plain, POINTS, key, 2), True)
            assert not np.allclose(points.numpy(), unmoved, atol=1e-2)


def test_sample_parameters_depend_on_seed_epoch_and_key_only():
    cfg = PointCloudConfig(batch_size=4, num_points=32, seed=1)
    a, b = sample_params(cfg, 50, "k", 0), sample_params(cfg, 50, "k", 0)
    assert np.array_equal(a.index, b.index) and a.angle == b.angle and a.scale == b.scale
    assert a.noise is not None and b.noise is not None and np.array_equal(a.noise, b.noise)
    for other in (sample_params(cfg, 50, "k", 1), sample_params(cfg, 50, "j", 0),
                  sample_params(PointCloudConfig(batch_size=4, num_points=32, seed=2), 50, "k",
                                0)):
        assert other.angle != a.angle and not np.array_equal(other.index, a.index)
    assert len(set(a.index.tolist())) == 32  # no repeats while the cloud has enough points
    padded = sample_params(cfg, 20, "k", 0).index
    assert sorted(set(padded.tolist())) == list(range(20)) and len(padded) == 32
    evaluation = sample_params(PointCloudConfig(batch_size=4, num_points=32, train=False),
                               50, "k", 0)
    assert evaluation.noise is None and evaluation.angle == 0 and evaluation.scale == 1
    assert np.array_equal(evaluation.index, np.arange(32) * 50 // 32)


def test_augmentation_of_a_key_does_not_depend_on_batching_or_ranks(shards):
    make = functools.partial(pointcloud_loader, shards, num_points=64, seed=3, **OPTS)
    whole = by_key(epoch(make(batch_size=8)))
    other_batches = by_key(epoch(make(batch_size=5)))
    ranks = {}
    for rank in range(2):
        ranks.update(by_key(epoch(make(batch_size=4, rank=rank, world_size=2))))
    for key, points in ranks.items():
        assert torch.equal(points, whole[key]) and torch.equal(points, other_batches[key])
    later = make(batch_size=8)
    later.set_epoch(1)
    moved = by_key(epoch(later))
    assert all(not torch.equal(moved[k], whole[k]) for k in whole)  # a new draw each epoch


# -- voxels ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, shape", [("occupancy", (1, 8, 8, 8)), ("count", (1, 8, 8, 8)),
                                         ("pillars", (4, 8, 8))])
def test_batches_carry_voxels_of_their_points(shards, mode, shape):
    with pointcloud_loader(shards, batch_size=16, num_points=64, voxels=mode, grid=8,
                           **OPTS) as loader:
        batch = next(iter(loader))
    assert batch.voxels.shape == (16, *shape) and batch.voxels.dtype == torch.float32
    assert torch.equal(batch.voxels, voxelize(batch.points, mode, grid=8, extent=1.0))
    inside = (batch.points.abs() < 1).all(-1).sum(1).float()  # scaled up to 1.2: some leave
    if mode == "count":
        assert torch.equal(batch.voxels.sum((1, 2, 3, 4)), inside)
    if mode == "occupancy":
        assert set(batch.voxels.unique().tolist()) == {0.0, 1.0}
        assert (batch.voxels.sum((1, 2, 3, 4)) > 5).all()


def test_voxel_counts_by_hand():
    # grid 2 over [-1, 1): cell 0 is [-1, 0), cell 1 is [0, 1) on each axis
    points = torch.tensor([[[-0.5, -0.5, -0.5], [0.5, 0.5, 0.5], [0.5, 0.5, 0.5],
                            [0.0, 0.0, 0.0], [-1.0, -1.0, -1.0], [-0.1, 0.7, 0.2],
                            [1.0, 0.0, 0.0], [5.0, 0.0, 0.0], [float("nan"), 0.0, 0.0]]])
    counts = voxelize(points, "count", grid=2, extent=1.0)
    expected = torch.zeros(1, 1, 2, 2, 2)
    expected[0, 0, 0, 0, 0] = 2  # (-0.5, ...) and the corner (-1, -1, -1)
    expected[0, 0, 1, 1, 1] = 3  # (0.5, ...) twice and the origin
    expected[0, 0, 0, 1, 1] = 1  # (-0.1, 0.7, 0.2)
    assert torch.equal(counts, expected)  # +1 (upper face), 5 and NaN are dropped
    assert torch.equal(voxelize(points, "occupancy", grid=2, extent=1.0), (expected > 0).float())
    second = torch.tensor([[[0.9, -0.9, 0.0], [0.1, 0.1, 0.1], [0.1, 0.1, 0.1],
                            [0.1, 0.1, 0.1], [-0.1, 0.1, 0.1]]] * 1)
    both = voxelize(torch.cat([points[:, :5], second]), "count", grid=2, extent=1.0)
    assert both[1, 0, 1, 0, 1] == 1 and both[1, 0, 1, 1, 1] == 3 and both[1].sum() == 5


def test_pillars_by_hand():
    points = torch.tensor([[[0.5, 0.5, -0.5], [0.5, 0.5, 0.5], [0.6, 0.1, 0.0],
                            [-0.5, -0.5, 1.5], [-0.5, 0.5, -1.0]]])
    pillars = voxelize(points, "pillars", grid=2, extent=1.0)
    assert pillars.shape == (1, 4, 2, 2)
    count, mean, low, high = pillars[0]
    # heights are (z + 1) / 2: -0.5 -> 0.25, 0.5 -> 0.75, 0 -> 0.5, -1 -> 0
    assert count.tolist() == [[0, 1], [0, 3]]  # z = 1.5 is above the grid: dropped
    assert torch.allclose(mean[1, 1], torch.tensor(0.5)) and mean[0, 1] == 0
    assert low[1, 1] == 0.25 and high[1, 1] == 0.75 and low[0, 1] == high[0, 1] == 0
    assert (pillars[0, :, 0, 0] == 0).all()  # an empty column is all zeros


def test_voxelize_refuses_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        voxelize(torch.zeros(1, 4, 3), "dense", grid=4, extent=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected"):
        voxelize(torch.zeros(4, 3), "count", grid=4, extent=1.0)


# -- resume and ranks --------------------------------------------------------------------------

@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_resume_mid_epoch_gives_exactly_the_same_next_batches(shards, reader):
    make = functools.partial(pointcloud_loader, shards, batch_size=4, seed=7, num_points=48,
                             voxels="count", grid=6, reader=reader, **OPTS)
    full = make()
    epoch(full)  # the snapshot is taken in epoch 1
    it = iter(full)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(full.state_dict()))  # as a checkpoint stores it
    rest = list(it)
    resumed = make()
    resumed.load_state_dict(state)
    again = epoch(resumed)
    assert [b.keys for b in again] == [b.keys for b in rest] and len(rest) == 6
    for a, b in zip(again, rest, strict=True):
        assert torch.equal(a.points, b.points) and torch.equal(a.label, b.label)
        assert torch.equal(a.voxels, b.voxels)
    assert resumed.epoch == full.epoch == 2


def test_two_ranks_are_disjoint_and_cover_every_cloud(shards, clouds):
    per_rank = [[k for b in epoch(pointcloud_loader(shards, batch_size=4, num_points=32,
                                                    rank=rank, world_size=2, **OPTS))
                 for k in b.keys] for rank in range(2)]
    plan = pointcloud_loader(shards, batch_size=4, rank=0, world_size=2, **OPTS).plan(0)
    assert len(per_rank[0]) == len(per_rank[1])
    assert not set(per_rank[0]) & set(per_rank[1])
    assert len(per_rank[0]) * 2 + plan.dropped == len(clouds)
    assert set(per_rank[0]) | set(per_rank[1]) <= set(clouds)


def test_two_ranks_cover_everything_when_the_split_is_even(tmp_path):
    src = make_pointcloud_folder(tmp_path / "src", per_class=4, points=32)
    out = tmp_path / "out"
    convert(ConvertConfig(kind="pointcloud", src=str(src), out=out, max_count=6, workers=1))
    keys = [[k for b in pointcloud_loader(out, batch_size=5, rank=r, world_size=2, **OPTS)
             for k in b.keys] for r in range(2)]
    assert sorted(keys[0] + keys[1]) == sorted(s["__key__"] for s in read_wds(out))


# -- bad clouds ------------------------------------------------------------------------------

def write_shard(folder: Path, samples: dict[str, dict[str, bytes]]) -> list[str]:
    writer = ShardWriter(folder, "train", max_count=1000, max_size=10**8)
    for key, members in samples.items():
        writer.write({"__key__": key, **members})
    writer.finish()
    return [str(folder / "train-000000.tar")]


def with_good_ones(bad: dict[str, dict[str, bytes]]) -> dict[str, dict[str, bytes]]:
    samples = {f"good{i}": {"npy": npy(good(100 + i)), "cls": b"0"} for i in range(5)}
    return {**dict(list(samples.items())[:2]), **bad, **dict(list(samples.items())[2:])}


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_every_bad_cloud_is_skipped_counted_and_named(tmp_path, reader):
    marker = tmp_path / "unpickled"
    bad = bad_samples(marker)
    source = write_shard(tmp_path, with_good_ones({k: m for k, (m, _) in bad.items()}))
    loader = pointcloud_loader(source, batch_size=4, num_points=16, on_error="skip",
                               num_classes=3, reader=reader, voxels="count", grid=4, **OPTS)
    batches = epoch(loader)
    keys = [k for b in batches for k in b.keys]
    assert sorted(keys) == [f"good{i}" for i in range(5)]
    assert all(len(b.keys) == len(b.points) == len(b.label) == len(b.voxels) for b in batches)
    assert {e["key"]: e["reason"] for e in loader.skipped} == {k: r for k, (_, r) in
                                                               bad.items()}
    assert all(e["source"].endswith("train-000000.tar") for e in loader.skipped)
    assert len(keys) + len(loader.skipped) == 5 + len(bad)  # read + skipped == total
    assert not marker.exists()


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_a_cloud_too_small_to_normalize_is_caught_and_only_it_is_read_back(tmp_path,
                                                                             monkeypatch,
                                                                             reader):
    """A cloud 1e-25 across: normalizing squares its offsets (below float32's smallest),
    the radius reads 0 and the points come out non-finite: skipped, named. The decode thread
    reads the points' finiteness back (on a GPU, a wait for the stream) only for a batch
    whose box extents allow that, not for every batch."""
    import sys

    reads: list[int] = []
    real = torch.isfinite

    def counted(t):  # type: ignore[no-untyped-def]
        if sys._getframe(1).f_code.co_filename.endswith("pointcloud/decode.py"):
            reads.append(len(t))
        return real(t)

    monkeypatch.setattr(torch, "isfinite", counted)
    (tmp_path / "plain").mkdir()
    (tmp_path / "tiny").mkdir()
    plain = write_shard(tmp_path / "plain", with_good_ones({}))
    loader = pointcloud_loader(plain, batch_size=4, num_points=16, reader=reader, **OPTS)
    assert sum(len(b.keys) for b in loader) == 5 and reads == []
    tiny = write_shard(tmp_path / "tiny", with_good_ones(
        {"tiny": {"npy": npy(good(9) * np.float32(1e-25)), "cls": b"0"}}))
    loader = pointcloud_loader(tiny, batch_size=8, num_points=16, reader=reader,
                               on_error="skip", **OPTS)
    assert sorted(k for b in loader for k in b.keys) == [f"good{i}" for i in range(5)]
    assert [(e["key"], e["reason"]) for e in loader.skipped] == [("tiny", "non-finite")]
    assert "normalizing overflowed" in loader.skipped[0]["detail"] and reads == [6]


@pytest.mark.parametrize("key", ["nan", "identical", "pickled", "huge", "flat", "nolabel"])
def test_a_bad_cloud_raises_naming_shard_key_and_reason(tmp_path, key):
    members, reason = bad_samples(tmp_path / "unpickled")[key]
    source = write_shard(tmp_path, with_good_ones({key: members}))
    with pytest.raises(DataError) as info:
        epoch(pointcloud_loader(source, batch_size=4, num_points=16, **OPTS))
    assert info.value.key == key and info.value.reason == reason
    assert f"train-000000.tar key '{key}'" in str(info.value)


def test_max_points_is_checked_from_the_header(tmp_path):
    source = write_shard(tmp_path, {"big": {"npy": npy(good(1, 200)), "cls": b"0"},
                                    "small": {"npy": npy(good(2, 50)), "cls": b"0"}})
    loader = pointcloud_loader(source, batch_size=2, max_points=100, on_error="skip", **OPTS)
    assert [b.keys for b in loader] == [["small"]]
    assert loader.skip_counts() == {"too-many-points": 1}


def test_other_dtypes_byte_orders_and_layouts_decode_to_the_same_points(tmp_path):
    cloud = good(11, 24) * 10
    variants = {"f4": cloud, "f8": cloud.astype(np.float64), "be": cloud.astype(">f4"),
                "fortran": np.asfortranarray(cloud), "i2": np.round(cloud).astype(np.int16),
                "extra": np.hstack([cloud, np.ones((24, 2), np.float32)])}
    source = write_shard(tmp_path, {k: {"npy": npy(v), "cls": b"0"} for k, v in
                                    variants.items()})
    batch = next(iter(pointcloud_loader(source, batch_size=6, train=False, num_points=24,
                                        **OPTS)))
    got = dict(zip(batch.keys, batch.points, strict=True))
    reference = sample_params(PointCloudConfig(batch_size=6, train=False, num_points=24), 24,
                              "x", 0)
    for key, array in variants.items():
        expected = augment_numpy(np.asarray(array, np.float32), reference, normalize=True)
        np.testing.assert_allclose(got[key].numpy(), expected, atol=1e-5, err_msg=key)


GEO = np.array([5_123_456.0, 4_987_654.0, 120.0])  # metres in a projected CRS


@pytest.mark.parametrize("backend", ["dali", "portable"])
def test_geographic_float64_clouds_from_other_tools_keep_their_precision(tmp_path, backend):
    """Shards written by webdataset's TarWriter, float64 clouds about 5e6 m from the origin
    (and integer centimetres): the loader takes an offset, as make_shards does, so points +
    batch.offset are the file's coordinates within float32's resolution of the cloud's extent,
    and the normalized cloud is the one near the origin. An offset member of the sample's own
    adds to the one taken."""
    import webdataset as wds

    local = np.random.default_rng(0).uniform(-1, 1, (64, 3))
    own = np.array([1e6, 2e6, 0.0])
    truth = {"geo": local + GEO, "both": local + GEO, "loc": local,
             "cm": np.round((local + GEO) * 100)}
    stored = {"geo": npy(truth["geo"]), "both": npy(truth["both"] - own), "loc": npy(local),
              "cm": npy(truth["cm"].astype(np.int64))}
    with wds.TarWriter(str(tmp_path / "s-000000.tar")) as sink:
        for key, data in stored.items():
            extra = {"offset.npy": npy(own)} if key == "both" else {}
            sink.write({"__key__": key, "npy": data, "cls": b"0", **extra})
    options = dict(batch_size=4, train=False, num_points=64, backend=backend, **OPTS)
    with pointcloud_loader(str(tmp_path / "s-000000.tar"), normalize=False,
                           **options) as loader:
        batch = next(iter(loader))
    assert batch.offset.dtype == torch.float64 and sorted(batch.keys) == sorted(truth)
    for key, points, offset in zip(batch.keys, batch.points, batch.offset, strict=True):
        want = truth[key]
        if key == "loc":  # near the origin: no offset, the float32 cast as before
            assert not offset.any() and np.array_equal(points.numpy(), want.astype(np.float32))
            continue
        assert offset.abs().max() > 1e5, key
        got = points.double().numpy() + offset.numpy()
        assert np.abs(got - want).max() <= 1e-6 * np.ptp(want, axis=0).max(), key
    with pointcloud_loader(str(tmp_path / "s-000000.tar"), **options) as loader:
        normalized = by_key(loader)
    for key in ("geo", "both"):
        torch.testing.assert_close(normalized[key], normalized["loc"], atol=1e-5, rtol=0)


@pytest.mark.dali  # a failure inside DALI's graph (numpy decodes big-endian data itself)
def test_a_graph_failure_is_traced_to_its_sample(tmp_path, monkeypatch):
    # Big-endian data is normally rewritten before DALI, whose decoder refuses it; without
    # that rewrite the batch fails inside DALI and must be traced to the sample.
    monkeypatch.setattr(pointcloud_sample, "_repacked", lambda data: data)
    samples = with_good_ones({"swapped": {"npy": npy(good(3).astype(">f4")), "cls": b"0"}})
    source = write_shard(tmp_path, samples)
    with pytest.raises(DataError, match="train-000000.tar key 'swapped': DALI cannot decode it: "
                       ".*Big Endian.*bad-cloud"):
        epoch(pointcloud_loader(source, batch_size=4, num_points=16, **OPTS))
    from shardflow.pointcloud.decode import DecodeStage

    builds: list[int | None] = []
    real_build = DecodeStage._build

    def counted(self, depth, batch_size=None):  # type: ignore[no-untyped-def]
        builds.append(batch_size)
        return real_build(self, depth, batch_size)

    monkeypatch.setattr(DecodeStage, "_build", counted)
    loader = pointcloud_loader(source, batch_size=4, num_points=16, on_error="skip", **OPTS)
    assert sorted(k for b in loader for k in b.keys) == [f"good{i}" for i in range(5)]
    assert [(e["key"], e["reason"]) for e in loader.skipped] == [("swapped", "bad-cloud")]
    # the failed batch's 4 samples went through one one-sample graph (two when the bad
    # one is not the last: a graph that failed is rebuilt), not one graph each
    assert 1 <= builds.count(1) <= 2, builds


@pytest.mark.parametrize("option, value", [("batch_size", 0), ("num_points", 0),
                                           ("voxels", "dense"), ("grid", -2),
                                           ("extent", float("nan")), ("rotate", 270.0),
                                           ("scale", (1.2, 0.8)), ("jitter", -0.1),
                                           ("max_points", 0), ("device", "tpu"),
                                           ("on_error", "ignore")])
def test_invalid_options_name_the_option(shards, option, value):
    with pytest.raises(ValueError, match=option):
        pointcloud_loader(shards, **{"batch_size": 4, option: value})


def test_unknown_option_is_refused(shards):
    with pytest.raises(TypeError, match="colour"):
        pointcloud_loader(shards, batch_size=4, colour=True)


# -- training ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def train_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """600 built-in clouds of 64 points, 50 per shard, spread over the shards at random: the
    tenth shard (50 clouds of every class) is held out for evaluation."""
    root = tmp_path_factory.mktemp("pctrain")
    src = make_pointcloud_folder(root / "src", per_class=100, points=64)
    run_tool("make_shards", "pointcloud", src, root / "out", "--max-count", 50,
             "--shuffle-seed", 0, "--quiet", check=True)
    return root / "out"


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two cores shared with the loader's threads: torch's OpenMP workers then spin on
    # barriers waiting for a thread that is not running; one thread ran the step ~30x faster.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def train(data: Path, out: Path, *args: object) -> dict:
    proc = run_tool("train", "--task", "pointcloud", "--data", data, "--out", out,
                    "--device", "cpu", "--num-points", 64, "--quiet", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "eval accuracy" in proc.stdout
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("model", ["pointnet", "voxnet"])
@pytest.mark.backend
def test_train_tool_runs_both_models_under_bf16(train_shards, tmp_path, model, one_thread):
    # Measured here over seeds 0-2: accuracy 0.54-0.66, eval loss 1.08-1.23, last logged
    # loss 0.54-0.76 of the first (2 cores, native bf16; most of the time is start-up).
    summary = train(train_shards, tmp_path / "run", "--model", model, "--steps", 80,
                    "--batch-size", 16, "--grid", 12, "--precision", "bf16")
    assert summary["steps"] == 80 and summary["precision"] == "bf16"
    assert summary["skipped_samples"] == 0
    assert summary["accuracy"] > 0.35, summary  # 6 classes: chance is 1/6
    assert summary["eval_loss"] < 1.5, summary  # chance: ln 6 = 1.79
    losses = [json.loads(line)["loss"]
              for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < 0.85 * losses[0], losses


# Measured on this data: 0.68-0.82 over seeds 0-2. PointNet learning (0.72-0.82 here) is the
# demo's to show: tests/test_demo.py.
@pytest.mark.accuracy
def test_voxnet_learns_the_primitives_far_above_chance(train_shards, tmp_path, one_thread):
    summary = train(train_shards, tmp_path / "run", "--model", "voxnet", "--steps", 300,
                    "--batch-size", 32, "--grid", 16)
    assert summary["accuracy"] > 0.6, summary  # chance is 1/6


def test_train_tool_refuses_an_unknown_model(train_shards, tmp_path):
    proc = run_tool("train", "--task", "pointcloud", "--data", train_shards, "--out",
                    tmp_path / "run", "--steps", 2, "--model", "resnet", "--device", "cpu")
    assert proc.returncode == 2 and "pointnet, voxnet" in proc.stderr


@pytest.mark.gpu
@pytest.mark.dali  # decode="gpu" runs DALI's graph on the device
def test_gpu_graph_gives_the_cpu_points_on_the_device(shards):
    make = functools.partial(pointcloud_loader, shards, batch_size=8, seed=2, num_points=64,
                             voxels="occupancy", grid=8, threads=1, shuffle_buffer=16)
    # decode="gpu" named: with "auto", a machine without DALI quietly decodes on the CPU.
    with make(device="cuda", decode="gpu") as gpu, make(device="cpu") as cpu:
        assert gpu.decode == "gpu" and cpu.decode == "cpu"
        on_gpu, on_cpu = next(iter(gpu)), next(iter(cpu))
    assert on_gpu.points.is_cuda and on_gpu.voxels.is_cuda and on_gpu.label.is_cuda
    assert on_gpu.keys == on_cpu.keys
    torch.testing.assert_close(on_gpu.points.cpu(), on_cpu.points, atol=1e-5, rtol=0)
    assert torch.equal(on_gpu.label.cpu(), on_cpu.label)


@pytest.mark.parametrize("side, dims", [(26, 3), (66, 2), (300, 3), (5000, 2)])
def test_the_device_cell_index_needs_no_host_tensor_and_is_the_cpu_one(side, dims,
                                                                       monkeypatch):
    """CUDA's row-major cell index (integer multiply-adds by Python numbers) equals the CPU's
    float matmul, also where side**dims passes 2**24 (float64 there); and it makes no tensor
    from host data (on CUDA that copy would wait for the stream)."""
    from shardflow.pointcloud import voxelize as vox

    gen = torch.Generator().manual_seed(side)
    cells = torch.randint(0, side, (3, 500, 3), generator=gen).float()
    cells[0, 0, :dims] = side - 1  # the last cell of a cloud
    expected = vox._flat(cells, side, dims, on_device=False)
    made: list[object] = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: (made.append(a), real(*a, **k))[1])
    got = vox._flat(cells, side, dims, on_device=True)
    monkeypatch.undo()
    assert made == [] and got.dtype == torch.int64 and torch.equal(got, expected)
    assert int(got[0, 0]) == side**dims - 1 and int(got.max()) < 3 * side**dims


@pytest.mark.parametrize("mode", ["occupancy", "count"])
@pytest.mark.parametrize("grid, extent, dtype", [(24, 1.0, torch.float32), (7, 0.35, torch.float64),
                                                 (1, 2.0, torch.float32), (16, 1.0, torch.float16)])
def test_the_cpu_voxelizer_is_the_torch_one(mode, grid, extent, dtype):
    """The CPU path (numpy, one spare cell for outsiders) gives the grid of the torch path
    that CUDA runs (padded border cut away), on points inside, on every face and edge of the
    cube, beyond it, NaN and infinite."""
    from shardflow.pointcloud import voxelize as vox

    gen = torch.Generator().manual_seed(grid)
    points = (torch.rand(5, 300, 3, generator=gen) * 2.4 - 1.2) * extent
    step = 2 * extent / grid
    edges = torch.tensor([-extent, extent, -extent + step, extent - step, 0.0, -1e30, 1e30])
    points[:, :49] = edges[torch.randint(0, len(edges), (5, 49, 3), generator=gen)]
    points[0, 0, 1], points[1, 1, 2], points[2, 2, 0] = float("nan"), float("inf"), -float("inf")
    points = points.to(dtype)
    got = voxelize(points, mode, grid=grid, extent=extent)
    assert torch.equal(got, vox._device_grid(points, mode, grid, extent))
    assert got.shape == (5, 1, grid, grid, grid) and got.dtype == torch.float32
    assert got.sum() > 0


def test_the_quick_bound_takes_an_offset_exactly_where_the_full_rule_does():
    """check_npy decides most float64 and integer clouds from their columns' bounds, without
    loading them (pointcloud_sample._cast_keeps): where it says the float32 cast keeps them,
    pointcloud_io.precision_offset must say no offset either, and the bytes go on as they
    were."""
    from shardflow.samples.pointcloud_io import precision_offset

    rng = np.random.default_rng(4)
    for centre in (0.0, 1e3, 1e5, 1e6, 5e6, 1e8):
        for extent in (0.5, 20.0, 4000.0):
            cloud = rng.uniform(-extent / 2, extent / 2, (500, 4)) + [centre, -centre, 7, 0]
            for array in (cloud, np.round(cloud * 100).astype(np.int64),
                          cloud.astype(">f8"), np.asfortranarray(cloud)):
                data = np.frombuffer(npy(array), np.uint8)
                out, rows, offset = pointcloud_sample.check_npy(data, 10_000)
                full = precision_offset(np.asarray(array))
                assert (offset is None) == (full is None), (centre, extent, array.dtype)
                if full is not None:
                    assert np.array_equal(offset, full)
                elif array.dtype == np.dtype("<f8") and array.flags.c_contiguous:
                    assert out is data  # untouched
