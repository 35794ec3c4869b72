"""image_loader(views=...): several augmented views of each sample, each drawn apart and
following its own op list, the same on both backends and after a resume."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from conftest import gpu_available, resumed_run
from PIL import Image
from test_ops import Invert

from shardflow import image_loader, ops
from shardflow.builtin import make_photo_corpus
from shardflow.image import augment
from shardflow.ops.crop import CenterCrop, RandomResizedCrop

BACKENDS = [pytest.param("dali", "dali", marks=pytest.mark.dali),
            pytest.param("stream", "dali", marks=pytest.mark.dali),
            ("stream", "portable")]


def _make(shards, reader: str = "stream", backend: str = "portable", **options
          ):  # type: ignore[no-untyped-def]
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    return image_loader(shards, batch_size=8, size=32, device="cpu", seed=3, threads=1,
                        reader=reader, backend=backend, use_tuning=False, **options)


def _dino() -> list[list[ops.Op]]:
    """DINO's multi-crop, small: 2 global crops and 3 local ones."""
    return [[RandomResizedCrop(32, scale=(0.4, 1.0)), ops.Flip()]] * 2 + \
        [[RandomResizedCrop(16, scale=(0.05, 0.4)), ops.Flip()]] * 3


@pytest.mark.parametrize("reader, backend", BACKENDS)
@pytest.mark.backend
def test_two_views_differ_and_the_first_is_the_loaders_own_image(op_shards, reader, backend):
    with _make(op_shards, reader, backend) as plain:
        want = list(plain)
    with _make(op_shards, reader, backend, views=2) as loader:
        got = list(loader)
        assert [v["crop"] for v in loader.describe()["views"]] == ["the loader's"] * 2
    assert [b.keys for b in got] == [b.keys for b in want] and len(got) == 5
    for a, b in zip(got, want, strict=True):
        assert len(a.views) == 2 and a.image is a.views[0]
        assert torch.equal(a.views[0], b.image)
        # drawn apart: another window (and flip) for nearly every sample
        assert (a.views[0] != a.views[1]).flatten(1).any(1).float().mean() >= 0.75


@pytest.mark.backend
def test_each_view_follows_its_own_op_list(op_shards):
    """An op added to one view changes that view alone, exactly as the op does; window ops
    give each view its size."""
    with _make(op_shards, views=_dino()) as loader:
        base = list(loader)
    inverted = _dino()
    inverted[3] = inverted[3] + [Invert(p=1.0)]
    inverted[0] = inverted[0] + [ops.Grayscale(p=1.0)]
    with _make(op_shards, views=inverted) as loader:
        changed = list(loader)
    for a, b in zip(base, changed, strict=True):
        assert [tuple(v.shape[1:]) for v in a.views] == [(3, 32, 32)] * 2 + [(3, 16, 16)] * 3
        assert torch.equal(b.views[3], 255 - a.views[3])
        grey = b.views[0]
        assert torch.equal(grey[:, 0], grey[:, 1]) and torch.equal(grey[:, 1], grey[:, 2])
        assert not torch.equal(grey, a.views[0])
        for v in (1, 2, 4):
            assert torch.equal(a.views[v], b.views[v])
        # the two global views (same op list) are drawn apart
        assert not torch.equal(a.views[0], a.views[1])


def _by_key(batches) -> dict[str, list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    return {k: [v[i] for v in b.views] for b in batches for i, k in enumerate(b.keys)}


@pytest.mark.dali
def test_views_are_the_same_on_both_backends(op_shards):
    """Each sample's views, whichever reader batched it: the same pixels (the readers
    shuffle apart; the draws are the sample's own)."""
    with _make(op_shards, "stream", "portable", views=_dino()) as loader:
        portable = _by_key(loader)
    for reader in ("stream", "dali"):
        with _make(op_shards, reader, "dali", views=_dino()) as loader:
            dali = _by_key(loader)
        assert sorted(dali) == sorted(portable) and len(dali) == 40
        for key, views in dali.items():
            assert all(torch.equal(x, y) for x, y in zip(views, portable[key], strict=True))


@pytest.mark.parametrize("reader, backend", BACKENDS)
@pytest.mark.backend
def test_views_with_ops_resume_bit_identical(op_shards, reader, backend):
    views = [[RandomResizedCrop(32), ops.RandAugment(2, 9)],
             [RandomResizedCrop(16, scale=(0.05, 0.4)), ops.ColorJitter(0.4, 0.4, 0.4, 0.1)]]

    def make():  # type: ignore[no-untyped-def]
        return _make(op_shards, reader, backend, views=views)

    head, rest, again = resumed_run(make)
    assert [b.keys for b in again] == [b.keys for b in rest] and len(rest) == 3
    for a, b in zip(again, rest, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.views, b.views, strict=True))
    assert len({k for b in head + rest for k in b.keys}) == 40


@pytest.mark.backend
def test_views_are_normalized_and_laid_out_after_their_ops(op_shards):
    views = [[RandomResizedCrop(32), Invert(0.5)], [CenterCrop(16)]]
    with _make(op_shards, views=views) as loader:
        want = next(iter(loader))
    with _make(op_shards, views=views, normalize=True, layout="NHWC") as loader:
        got = next(iter(loader))
        mean, std = torch.tensor(loader.cfg.mean), torch.tensor(loader.cfg.std)
    for a, b in zip(got.views, want.views, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.permute(0, 2, 3, 1).shape
        assert torch.allclose(a, (b.permute(0, 2, 3, 1).float() - mean) / std)


@pytest.mark.backend
def test_a_skipped_sample_leaves_every_view_aligned(tmp_path):
    from test_image_loader import _bad_shards, _corrupt_scan

    out = _bad_shards(tmp_path, {"class0_img004.jpg": _corrupt_scan(1)})
    with image_loader(out, batch_size=4, size=32, device="cpu", threads=1, train=False,
                      on_error="skip", backend="portable", use_tuning=False) as plain:
        alone = {k: b.image[i] for b in plain for i, k in enumerate(b.keys)}
    with image_loader(out, batch_size=4, size=32, device="cpu", threads=1, train=False,
                      on_error="skip", backend="portable", use_tuning=False,
                      views=[[], [CenterCrop(16, 0.5)]]) as loader:
        batches = list(loader)
        assert loader.skip_counts() == {"bad-image": 1}
    assert sorted(len(b) for b in batches) == [3, 4, 4]
    for b in batches:
        assert [len(v) for v in b.views] == [len(b)] * 2
        for i, k in enumerate(b.keys):
            assert torch.equal(b.views[0][i], alone[k])


def test_window_ops_outside_a_loader_are_pils_crop_and_resize(tmp_path):
    """ops.apply over a batch: RandomResizedCrop's window, resized antialiased bilinear, is
    PIL's resize of that box within a few levels (PIL's filter works in fixed point)."""
    folder = make_photo_corpus(tmp_path / "photos", count=4)
    photos = [Image.open(f).convert("RGB").resize((96, 72))
              for f in sorted(folder.rglob("*.jpg"))]
    images = torch.stack([torch.from_numpy(np.array(p)).permute(2, 0, 1) for p in photos])
    op = RandomResizedCrop(40, scale=(0.3, 1.0))
    rngs = ops.sample_rngs(0, 0, ["a", "b", "c", "d"])
    seeds = [op.draw(r) for r in ops.sample_rngs(0, 0, ["a", "b", "c", "d"])]
    got = ops.apply([op], images, rngs)
    windows = [op.window(random.Random(seed), 96, 72) for seed in seeds]
    assert (0, 0, 96, 72) not in windows  # crops, not only the resize
    for image, photo, (x, y, w, h) in zip(got, photos, windows, strict=True):
        want = np.array(photo.resize((40, 40), Image.Resampling.BILINEAR,
                                     box=(x, y, x + w, y + h)))
        diff = np.abs(image.permute(1, 2, 0).numpy().astype(int) - want.astype(int))
        # measured on these photos (windows of 90x72 down to 56x44 into 40): at most 4
        # levels apart, up to 2% of values by more than 1 and 0.4% by more than 2, a mean
        # of 0.16-0.24 (PIL's filter is fixed point, torch's float)
        assert diff.max() <= 5 and (diff > 2).mean() < 0.01 and diff.mean() < 0.4


def _ks_uniform(values: np.ndarray, lo: float, hi: float) -> float:
    """Kolmogorov-Smirnov statistic of `values` against the uniform distribution on
    [lo, hi]: the largest gap between their empirical CDF and the straight line."""
    x = np.sort((np.asarray(values, float) - lo) / (hi - lo))
    n = len(x)
    return float(max((np.arange(1, n + 1) / n - x).max(), (x - np.arange(n) / n).max()))


def test_random_resized_crop_windows_follow_torchvisions_distribution():
    """RandomResizedCrop's windows, and the loader's crop (the same draws with a flip), as
    torchvision's get_params defines them, 4,000 draws a case. Where every try fits (at
    most half the area of a square), the area's share is uniform in `scale` and
    log(w / h) uniform in log(ratio), each a KS statistic below 1.95 / sqrt(n) (the 0.001
    level: 0.031), the position uniform over where the window fits. Near the whole area a
    try fits with probability p (from the definition: scale <= min(r, 1/r)), so
    (1 - p) ** 10 of the windows are the fallback, the largest centred window within
    `ratio` (here the whole image); an image outside `ratio` always falls back."""
    n, side = 4000, 1000
    crit = 1.95 / math.sqrt(n)
    op = RandomResizedCrop(32, scale=(0.1, 0.5))
    rng = random.Random(0)
    windows = np.array([op.window(rng, side, side) for _ in range(n)], float)
    x, y, w, h = windows.T
    assert (x >= 0).all() and (y >= 0).all() and (x + w <= side).all() and (y + h <= side).all()
    share = w * h / side**2  # w and h are rounded to pixels: within 0.4% of the drawn area
    assert share.min() >= 0.1 * 0.996 and share.max() <= 0.5 * 1.004
    assert _ks_uniform(share, 0.1, 0.5) < crit
    assert _ks_uniform(np.log(w / h), math.log(3 / 4), math.log(4 / 3)) < crit
    assert _ks_uniform(x / (side - w), 0, 1) < crit and _ks_uniform(y / (side - h), 0, 1) < crit
    crops = [augment.random_resized_crop(rng, side, side, (0.1, 0.5), (3 / 4, 4 / 3))
             for _ in range(n)]
    assert _ks_uniform([c.width * c.height / side**2 for c in crops], 0.1, 0.5) < crit
    assert sum(c.flip for c in crops) / n == pytest.approx(0.5, abs=4 * 0.5 / math.sqrt(n))

    lo, ratio = 0.9, (3 / 4, 4 / 3)
    u = np.linspace(0, math.log(ratio[1]), 200_001)  # |log r|, uniform on this range
    p = np.clip((np.exp(-u) - lo) / (1 - lo), 0, 1).mean()  # P(a try fits): about 0.18
    big = RandomResizedCrop(32, scale=(lo, 1.0), ratio=ratio)
    drawn = np.array([big.window(rng, side, side) for _ in range(n)], float)
    full = (drawn == (0, 0, side, side)).all(axis=1)
    expect = (1 - p) ** 10
    assert abs(full.mean() - expect) < 4 * math.sqrt(expect * (1 - expect) / n)
    tried = drawn[~full]
    share, aspect = tried[:, 2] * tried[:, 3] / side**2, tried[:, 2] / tried[:, 3]
    assert share.min() >= lo * 0.998 and ratio[0] * 0.998 <= aspect.min()
    assert aspect.max() <= ratio[1] * 1.002
    # outside `ratio` no try fits: the centred window of the nearest ratio, whole one way
    assert big.window(rng, 1000, 100) == ((1000 - 133) // 2, 0, 133, 100)
    assert big.window(rng, 100, 1000) == (0, (1000 - 133) // 2, 100, 133)


@pytest.mark.backend
def test_what_cannot_be_views_is_refused(op_shards):
    with pytest.raises(ValueError, match="batch_augment"):
        _make(op_shards, views=2, batch_augment=[ops.MixUp(classes=10)])
    with pytest.raises(ValueError, match="can only come first"):
        _make(op_shards, views=[[ops.Flip(), RandomResizedCrop(16)]])
    with pytest.raises(ValueError, match="put each view's ops in its list"):
        _make(op_shards, views=[[RandomResizedCrop(16)]], augment=[ops.Flip()])
    with pytest.raises(ValueError, match="at least 1"):
        _make(op_shards, views=0)
    with pytest.raises(ValueError, match="a list of op lists"):
        _make(op_shards, views=[RandomResizedCrop(16)])
    with pytest.raises(ValueError, match="is not a shardflow.ops.Op"):
        _make(op_shards, views=2, augment=[lambda x: x])  # checked at build, not in a batch


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CUDA (no GPU on this machine)")
def test_views_on_a_gpu_are_the_cpu_views(op_shards):
    with _make(op_shards, views=_dino()) as cpu:
        want = list(cpu)
    with image_loader(op_shards, batch_size=8, size=32, device="cuda", seed=3, threads=1,
                      reader="stream", backend="portable", use_tuning=False,
                      views=_dino()) as gpu:
        got = list(gpu)
    for a, b in zip(got, want, strict=True):
        assert all(x.is_cuda and torch.equal(x.cpu(), y)
                   for x, y in zip(a.views, b.views, strict=True))


@pytest.mark.backend
def test_views_made_after_delivery_on_the_cpu_are_the_cpu_views(op_shards, monkeypatch):
    """The CPU twin of the test above: views resized in the decode stage and their ops run
    once the batch is delivered (a GPU loader's route, taken on the CPU) are the views of
    the ops run in the decode stage."""
    from shardflow.image import batchops

    with _make(op_shards, views=_dino()) as cpu:
        want = list(cpu)
    monkeypatch.setattr(batchops, "after_delivery", lambda placement: True)
    with _make(op_shards, views=_dino()) as late:
        got = list(late)
        assert late._decoder.batch_ops is None
    for a, b in zip(got, want, strict=True):
        assert len(a.views) == len(b.views) == 5
        assert all(torch.equal(x, y) for x, y in zip(a.views, b.views, strict=True))
