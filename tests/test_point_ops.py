"""Point-cloud ops (shardflow.ops.points): the loader's own rotation, scale and jitter
expressed as ops (run in its graph), a user's ops after them in torch, before the voxels,
drawn per cloud from (seed, epoch, key): the same on both backends and after a resume."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from conftest import resumed_run

from shardflow import ops, pointcloud_loader
from shardflow.builtin import make_pointcloud_folder
from shardflow.convert import ConvertConfig, convert

P = ops.points
BACKENDS = [pytest.param("dali", "dali", marks=pytest.mark.dali),
            pytest.param("stream", "dali", marks=pytest.mark.dali),
            ("stream", "portable")]


class FlipX(P.PointOp):
    """A user's own op: x negated for a share p of the clouds."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def draw(self, rng: random.Random) -> bool:
        return rng.random() < self.p

    def torch(self, points: torch.Tensor, params) -> torch.Tensor:  # type: ignore[no-untyped-def]
        sign = torch.tensor([-1.0 if q else 1.0 for q in params]).view(-1, 1)
        out = points.clone()
        out[..., 0] = points[..., 0] * sign.to(points.device)
        return out


@pytest.fixture(scope="module")
def cloud_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pointops")
    src = make_pointcloud_folder(root / "src", per_class=4, points=200)
    convert(ConvertConfig(kind="pointcloud", src=str(src), out=root / "out", max_count=8,
                          workers=1))
    return root / "out"


def _make(shards, reader="stream", backend="portable", **options):  # type: ignore[no-untyped-def]
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    return pointcloud_loader(shards, batch_size=8, num_points=64, device="cpu", threads=1,
                             seed=2, reader=reader, backend=backend, use_tuning=False,
                             **options)


def _by_key(batches) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {k: b.points[i] for b in batches for i, k in enumerate(b.keys)}


@pytest.mark.parametrize("reader, backend", BACKENDS)
def test_the_loaders_own_augmentation_is_three_ops_in_its_graph(cloud_shards, reader, backend):
    with _make(cloud_shards, reader, backend, rotate=90, scale=(0.7, 1.1), jitter=0.02) as a:
        want = _by_key(a)
    recipe = [P.Scale((0.7, 1.1)), P.RotateZ(90), P.Jitter(0.02)]  # scale and turn commute
    with _make(cloud_shards, reader, backend, augment=recipe) as b:
        got = _by_key(b)
        where = b.describe()["augment"]
    assert sorted(got) == sorted(want) and len(got) == 24
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(e["runs"] in ("the DALI graph (cpu)", "the portable backend's numpy transform")
               for e in where) and len(where) == 3


@pytest.mark.parametrize("reader, backend", BACKENDS)
def test_a_users_ops_run_after_the_graphs_in_torch(cloud_shards, reader, backend):
    """[RotateZ, Dropout, FlipX]: the graph turns, torch drops and flips, each cloud as
    points.apply draws for its key."""
    with _make(cloud_shards, reader, backend, augment=[P.RotateZ(45)]) as a:
        turned = list(a)
    with _make(cloud_shards, reader, backend,
               augment=[P.RotateZ(45), P.Dropout(0.8), FlipX(0.5)]) as b:
        got = _by_key(b)
        where = [e["runs"] for e in b.describe()["augment"]]
    assert where[1:] == ["torch in the decode stage, on the CPU"] * 2
    for batch in turned:
        want = P.apply([P.Dropout(0.8), FlipX(0.5)], batch.points,
                       ops.sample_rngs(2, 0, batch.keys))
        for i, key in enumerate(batch.keys):
            assert torch.equal(got[key], want[i]), key


def test_ops_come_before_the_voxels(cloud_shards):
    """An op moving every cloud off the grid leaves empty voxels: binned after the ops."""
    class Away(P.PointOp):
        def draw(self, rng: random.Random) -> None:
            return None

        def torch(self, points, params):  # type: ignore[no-untyped-def]
            return points + 10.0

    with _make(cloud_shards, voxels="occupancy", grid=8) as plain:
        assert next(iter(plain)).voxels.sum() > 0
    with _make(cloud_shards, voxels="occupancy", grid=8, augment=[Away()]) as moved:
        assert next(iter(moved)).voxels.sum() == 0


@pytest.mark.parametrize("reader, backend", BACKENDS)
def test_point_ops_resume_bit_identical(cloud_shards, reader, backend):
    def make():  # type: ignore[no-untyped-def]
        return _make(cloud_shards, reader, backend,
                     augment=[P.RotateZ(180), P.Jitter(0.01), P.Dropout(), FlipX()])

    head, rest, again = resumed_run(make, after=1)
    assert [b.keys for b in again] == [b.keys for b in rest] and len(rest) == 2
    assert all(torch.equal(a.points, b.points) for a, b in zip(again, rest, strict=True))
    assert len({k for b in head + rest for k in b.keys}) == 24


def test_the_torch_forms_follow_their_definitions():
    gen = torch.Generator().manual_seed(0)
    clouds = torch.randn(64, 50, 4, generator=gen)  # a fourth channel rides along
    keys = [f"c{i}" for i in range(64)]
    angles = [P.RotateZ(30).draw(r) for r in ops.sample_rngs(0, 0, keys)]
    turned = P.apply([P.RotateZ(30)], clouds, ops.sample_rngs(0, 0, keys))
    for i, a in enumerate(angles):
        c, s = math.cos(math.radians(a)), math.sin(math.radians(a))
        x, y = clouds[i, :, 0], clouds[i, :, 1]
        assert torch.allclose(turned[i, :, 0], c * x - s * y, atol=1e-5)
        assert torch.allclose(turned[i, :, 1], s * x + c * y, atol=1e-5)
    assert torch.equal(turned[..., 2:], clouds[..., 2:]) and max(map(abs, angles)) <= 30
    scaled = P.apply([P.Scale((0.5, 2.0))], clouds, ops.sample_rngs(0, 0, keys))
    ratio = scaled[..., :3] / clouds[..., :3]
    assert torch.allclose(ratio, ratio[:, :1, :1].expand_as(ratio), atol=1e-4)
    assert 0.5 <= ratio.min() and ratio.max() <= 2.0
    noisy = P.apply([P.Jitter(0.05)], clouds, ops.sample_rngs(0, 0, keys))
    noise = noisy[..., :3] - clouds[..., :3]
    assert abs(noise.std().item() - 0.05) < 0.003 and abs(noise.mean().item()) < 0.003
    dropped = P.apply([P.Dropout(0.875)], clouds, ops.sample_rngs(0, 0, keys))
    share = (dropped == dropped[:, :1]).all(-1).float().mean(1)  # the first point's copies
    assert 0.3 < share.mean().item() < 0.55  # ratio ~ U(0, 0.875): about 0.44 dropped
    assert torch.equal(dropped[:, 0], clouds[:, 0])


def test_what_cannot_be_point_ops_is_refused(cloud_shards):
    with pytest.raises(ValueError, match="not a shardflow.ops.points op"):
        _make(cloud_shards, augment=[ops.Flip()])
    with pytest.raises(ValueError, match="training loaders"):
        _make(cloud_shards, augment=[P.RotateZ(10)], train=False)
    with pytest.raises(ValueError, match="RotateZ degrees"):
        P.RotateZ(200)
