"""The portable backend (PIL/numpy + torch, no DALI) against the DALI backend's contract: the
same windows and parameters from (seed, epoch, key), the same batch types, skips, resume and
rank split, EXIF orientation, and pixels or points that agree with DALI's.

Tests marked `dali` compare with the DALI backend and are skipped where DALI does not import
(the Makefile's no-DALI run); the others hold on their own in both runs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, dali_available, jpeg_bytes, run_tool
from PIL import Image, ImageDraw, ImageOps

from shardflow import image_loader, pointcloud_loader, text_loader
from shardflow.builtin import (
    make_image_folder,
    make_photo_corpus,
    make_pointcloud_folder,
    make_text_corpus,
)
from shardflow.convert import ConvertConfig, convert
from shardflow.errors import DataError
from shardflow.image import augment, resize
from shardflow.image.portable import decode_window, draft_scale
from shardflow.loading import readers
from shardflow.loading.rng import sample_rng
from shardflow.pointcloud.portable import transform
from shardflow.pointcloud.sample import SampleParams
from shardflow.samples import headers
from shardflow.shards.writer import ShardWriter

OPTS = {"device": "cpu", "threads": 2, "shuffle_buffer": 16, "use_tuning": False}
# Pixels of a window decoded at 1/2-1/8 scale (PIL's draft, leaving the window at least 2x
# the output size) and resized, against the same window decoded whole and resized as DALI's
# CPU path does: the mean |difference| per image, in uint8 steps, and the largest at any
# pixel (a hard edge). Measured on photo-like JPEGs of 128-1400 px resized to 32-224, eval and
# training windows: per image 1.69 at most (a draft that left the window barely the output
# size: 5.1), any pixel 28 at most (85). docs/portable.md has the table.
DRAFT_TOLERANCE = 2.0
DRAFT_MAX = 40


def _shards(root: Path, kind: str, src: Path, per_shard: int) -> Path:
    convert(ConvertConfig(kind=kind, src=str(src), out=root / "out", max_count=per_shard,
                          workers=1))
    return root / "out"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 small images (48 px: every window under twice the size, no draft) in 10 classes."""
    root = tmp_path_factory.mktemp("portable-img")
    return _shards(root, "imagefolder", make_image_folder(root / "src", per_class=3, size=48),
                   8)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 photo-like JPEGs (350-500 px): resized to 64, most windows are drafted."""
    root = tmp_path_factory.mktemp("portable-photos")
    return _shards(root, "imagefolder", make_photo_corpus(root / "src", count=16), 8)


@pytest.fixture(scope="module")
def small_photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 photo-like JPEGs of 128-416 px on the long side (quality 90): where backend="auto"
    takes the portable backend for outputs of 32-64 px, and the draft scales deepest."""
    root = tmp_path_factory.mktemp("portable-small-photos")
    for k, long_side in enumerate(np.linspace(128, 416, 24).round().astype(int)):
        folder = root / "src" / f"c{k % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"p{k:02d}.jpg").write_bytes(_photo(np.random.default_rng(k), long_side))
    return _shards(root, "imagefolder", root / "src", 8)


def _photo(rng: np.random.Generator, long_side: int) -> bytes:
    """A photo's content at its own size: a colour gradient, shading at a few scales,
    hard-edged shapes and thin lines, sensor-like grain; JPEG at quality 90."""
    short = round(long_side * rng.uniform(0.75, 1.0))
    width, height = (long_side, short) if rng.random() < 0.5 else (short, long_side)
    yy, xx = np.mgrid[0:height, 0:width] / max(width, height)
    start, end = rng.uniform(30, 225, (2, 3))
    pixels = start + (end - start) * ((xx + yy) / 2)[..., None]
    for cells, weight in ((4, 0.2), (16, 0.1), (64, 0.05)):
        grid = rng.normal(size=(cells, cells)).astype(np.float32)
        shade = np.asarray(Image.fromarray(grid, "F").resize((width, height),
                                                             Image.Resampling.BICUBIC))
        pixels = pixels * (1 + weight * shade[..., None])
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)

    def spot() -> tuple[float, float]:
        return float(rng.uniform(0, width)), float(rng.uniform(0, height))

    for _ in range(6):
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        draw.polygon([spot() for _ in range(int(rng.integers(3, 6)))], fill=colour)
    for _ in range(12):
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        draw.line([spot(), spot()], fill=colour, width=int(rng.integers(1, 4)))
    grain = rng.normal(0, rng.uniform(2, 8), (height, width, 3))
    out = io.BytesIO()
    Image.fromarray(np.clip(np.asarray(img) + grain, 0, 255).astype(np.uint8)).save(
        out, "JPEG", quality=90)
    return out.getvalue()


@pytest.fixture(scope="module")
def clouds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("portable-pc")
    return _shards(root, "pointcloud", make_pointcloud_folder(root / "src", per_class=3,
                                                              points=80), 8)


def images_by_key(loader) -> dict[str, torch.Tensor]:
    with loader:
        return {k: img for b in loader for k, img in zip(b.keys, b.image, strict=True)}


# -- the contract on its own ---------------------------------------------------------------------

@pytest.mark.parametrize("layout, normalize", [("NCHW", False), ("NHWC", True)])
@pytest.mark.backend
def test_batches_have_the_dali_backends_types_and_layouts(shards, layout, normalize):
    with image_loader(shards, batch_size=8, size=32, backend="portable", layout=layout,
                      normalize=normalize, **OPTS) as loader:
        batches = list(loader)
        assert loader.backend == "portable" and loader.reader == "stream"
    shape = (8, 3, 32, 32) if layout == "NCHW" else (8, 32, 32, 3)
    assert tuple(batches[0].image.shape) == shape and len(batches) == len(loader) == 4
    assert batches[0].image.dtype == (torch.float32 if normalize else torch.uint8)
    assert batches[0].label.dtype == torch.int64 and batches[0].image.float().std() > 0.2
    keys = [k for b in batches for k in b.keys]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 30
    assert [int(k[:2]) for k in keys] == torch.cat([b.label for b in batches]).tolist()


@pytest.mark.backend
def test_resume_mid_epoch_gives_exactly_the_rest(shards):
    make = functools.partial(image_loader, shards, batch_size=4, size=32, seed=3,
                             backend="portable", **OPTS)
    with make() as full:
        it = iter(full)
        for _ in range(3):
            next(it)
        state = full.state_dict()
        rest = list(it)
    assert state["backend"] == "portable" and len(rest) == 5
    with make() as resumed:
        resumed.load_state_dict(state)
        again = list(resumed)
    assert [b.keys for b in again] == [b.keys for b in rest]
    assert all(torch.equal(a.image, b.image) for a, b in zip(again, rest, strict=True))


@pytest.mark.backend
def test_a_state_is_tied_to_its_backend(shards):
    with image_loader(shards, batch_size=4, size=32, backend="portable", **OPTS) as loader:
        state = loader.state_dict()
        for other in ({**state, "backend": "dali"},
                      {k: v for k, v in state.items() if k != "backend"}):  # older: DALI's
            with pytest.raises(ValueError, match="saved by the 'dali' backend and this loader "
                               "uses 'portable'.*backend='dali'"):
                loader.load_state_dict(other)


@pytest.mark.backend
def test_ranks_read_disjoint_shards_and_equal_batches(shards):
    keys = []
    for rank in range(2):
        with image_loader(shards, batch_size=4, size=32, backend="portable", rank=rank,
                          world_size=2, **OPTS) as loader:
            keys.append([k for b in loader for k in b.keys])
            plan = loader.plan(0)
    assert len(keys[0]) == len(keys[1]) and not set(keys[0]) & set(keys[1])
    assert len(keys[0]) * 2 + plan.dropped == 30


def _bad_image_shard(tmp_path: Path) -> Path:
    writer = ShardWriter(tmp_path, "train", max_count=100, max_size=10**8)
    good = jpeg_bytes(3)
    for i in range(6):
        writer.write({"__key__": f"good{i}", "jpg": jpeg_bytes(i), "cls": b"1"})
        if i == 2:  # header intact, the scan cut short: only a decode finds it
            writer.write({"__key__": "cut", "jpg": good[: len(good) // 2], "cls": b"0"})
    writer.finish()
    return tmp_path / "train-000000.tar"


@pytest.mark.parametrize("backend", ["portable", "dali"])
@pytest.mark.backend
def test_a_bad_image_is_raised_naming_shard_and_key_or_skipped(tmp_path, backend):
    make = functools.partial(image_loader, [str(_bad_image_shard(tmp_path))], batch_size=4,
                             size=32, backend=backend, reader="stream", **OPTS)
    with pytest.raises(DataError, match=r"train-000000.tar.*'cut'.*bad-image"), make() as loader:
        list(loader)
    with make(on_error="skip") as loader:
        keys = [k for b in loader for k in b.keys]
        assert loader.skip_counts() == {"bad-image": 1} and loader.skipped[0]["key"] == "cut"
    assert sorted(keys) == [f"good{i}" for i in range(6)]


@pytest.mark.parametrize("backend", ["portable", "dali"])
@pytest.mark.backend
def test_a_jpeg_cut_below_its_window_is_refused_every_time(tmp_path, backend):
    """A photo missing its last rows, whose windows end above them: DALI's window decode
    never reached the missing rows, so it was delivered when alone in its batch and refused
    when another sample failed the batch (PIL's check then ran on all of it). Now refused
    on both backends, in every batch and epoch; a photo that only lacks its end marker too,
    as PIL refuses it."""
    if backend == "dali" and not dali_available():
        pytest.skip("needs nvidia.dali")
    whole = jpeg_bytes(5, (800, 600))
    writer = ShardWriter(tmp_path, "train", max_count=100, max_size=10**8)
    writer.write({"__key__": "whole", "jpg": whole, "cls": b"1"})
    writer.write({"__key__": "short", "jpg": whole[: len(whole) * 39 // 40], "cls": b"1"})
    writer.write({"__key__": "no-end", "jpg": whole[:-2], "cls": b"1"})
    writer.finish()
    for train, batch_size in ((False, 1), (True, 1), (True, 3)):
        with image_loader([str(tmp_path / "train-000000.tar")], batch_size=batch_size,
                          size=32, backend=backend, reader="stream", on_error="skip",
                          train=train, crop_scale=(0.05, 0.1), **OPTS) as loader:
            for _ in range(2):  # epochs
                assert [k for b in loader for k in b.keys] == ["whole"]
            assert loader.skip_counts() == {"bad-image": 4}
            assert "truncated" in loader.skipped[0]["detail"]


@pytest.mark.parametrize("backend", ["portable", "dali"])
@pytest.mark.backend
def test_max_pixels_above_pils_own_limit_is_the_callers(tmp_path, monkeypatch, backend):
    """Image.open refuses an image over twice Image.MAX_IMAGE_PIXELS (179M pixels) whatever
    max_pixels said: the portable backend skipped such photos as too-many-pixels (and its
    check did, on either backend) where DALI decoded them. At small scale: PIL's limit at
    2000, photos of 4800 pixels."""
    from shardflow.samples.checks import CheckLimits, check_image

    if backend == "dali" and not dali_available():
        pytest.skip("needs nvidia.dali")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # restored after the test
    writer = ShardWriter(tmp_path, "train", max_count=100, max_size=10**8)
    for i in range(3):
        writer.write({"__key__": f"big{i}", "jpg": jpeg_bytes(i, (60, 80)), "cls": b"1"})
    writer.finish()
    with image_loader([str(tmp_path / "train-000000.tar")], batch_size=2, size=32,
                      backend=backend, reader="stream", max_pixels=10_000, train=False,
                      **OPTS) as loader:
        assert sorted(k for b in loader for k in b.keys) == ["big0", "big1", "big2"]
        assert loader.skipped == []
    assert check_image(jpeg_bytes(0, (60, 80)), CheckLimits(max_pixels=10_000)) == "JPEG"
    with pytest.raises(DataError, match=r"more than max_pixels=1000 \[too-many-pixels\]"):
        check_image(jpeg_bytes(0, (60, 80)), CheckLimits(max_pixels=1000))
    assert Image.MAX_IMAGE_PIXELS == 5_000  # PIL refuses above twice it: raised to half
    Image.MAX_IMAGE_PIXELS = 6_000  # a limit of the application's own, which max_pixels
    assert check_image(jpeg_bytes(0, (60, 80)), CheckLimits(max_pixels=10_000)) == "JPEG"
    assert Image.MAX_IMAGE_PIXELS == 6_000  # does not need raised: left as it is


# -- EXIF orientation -----------------------------------------------------------------------------

def _oriented_shards(root: Path, side: tuple[int, int]) -> tuple[Path, dict[str, bytes]]:
    """One JPEG per EXIF orientation 1-8, of a smooth asymmetric picture, `side` as stored."""
    yy, xx = np.mgrid[0: side[1], 0: side[0]]
    pixels = np.stack([xx * 255 // side[0], yy * 255 // side[1], (xx + 2 * yy) % 256], -1)
    folder, stored = root / "src" / "c", {}
    folder.mkdir(parents=True)
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        out = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(out, "JPEG", quality=95, exif=exif)
        (folder / f"o{orientation}.jpg").write_bytes(out.getvalue())
        stored[f"c_o{orientation}"] = out.getvalue()
    return _shards(root, "imagefolder", root / "src", 8), stored


def _upright_reference(data: bytes, key: str, size: int, seed: int, turn: bool = True
                       ) -> torch.Tensor:
    """PIL's exif_transpose, then the window drawn upright from (seed, epoch 0, key), resized
    by resize.py and flipped: what a loader with exif_orientation=True must give (`turn`
    False: the same from the pixels as stored, the tag ignored)."""
    upright = Image.open(io.BytesIO(data))
    upright = (ImageOps.exif_transpose(upright) if turn else upright).convert("RGB")
    w = augment.random_resized_crop(sample_rng(seed, 0, key), upright.width, upright.height,
                                    (0.08, 1.0), (3 / 4, 4 / 3))
    window = np.array(upright.crop((w.x, w.y, w.x + w.width, w.y + w.height)))
    return resize.batch([window], [w.flip], size, True, None)[0]


@pytest.mark.parametrize("side, tolerance", [((60, 44), 1.0), ((400, 280), DRAFT_TOLERANCE)])
@pytest.mark.backend
def test_exif_orientation_agrees_with_pil_exif_transpose(tmp_path, side, tolerance):
    """Small images (no draft): equal to PIL's upright reference up to a rounding step;
    large ones (drafted) within the draft tolerance, and far from the image not turned."""
    out, stored = _oriented_shards(tmp_path, side)
    got = images_by_key(image_loader(out, batch_size=8, size=32, seed=5, backend="portable",
                                     **OPTS))
    assert sorted(got) == sorted(stored)
    for key, data in stored.items():
        want = _upright_reference(data, key, 32, seed=5).float()
        diff = (got[key].float() - want).abs()
        assert diff.mean() < tolerance and (diff.max() <= 1 or tolerance > 1), (key, diff)
        if key != "c_o1":  # turned: the tag ignored would be far off
            stored_frame = _upright_reference(data, key, 32, seed=5, turn=False).float()
            assert (got[key].float() - stored_frame).abs().mean() > 3 * tolerance, key


# -- against the DALI backend ---------------------------------------------------------------------

@pytest.mark.dali
@pytest.mark.parametrize("train", [True, False])
def test_pixels_equal_the_dali_backends_where_no_draft_applies(shards, train):
    """Same windows from (seed, epoch, key) whatever the reader: DALI's own reader and
    shuffle against the portable backend's streaming, compared by key, bit for bit (both
    decode with libjpeg-turbo; the resize is the same torch code)."""
    common = {"batch_size": 8, "size": 32, "seed": 7, "train": train, **OPTS}
    dali = images_by_key(image_loader(shards, backend="dali", **common))
    portable = images_by_key(image_loader(shards, backend="portable", **common))
    assert sorted(dali) == sorted(portable) and len(dali) == 30
    assert all(torch.equal(dali[k], portable[k]) for k in dali)


@pytest.mark.dali
def test_drafted_pixels_agree_with_dali_within_resampling_noise(photos):
    common = {"batch_size": 8, "size": 64, "seed": 1, **OPTS}
    dali = images_by_key(image_loader(photos, backend="dali", **common))
    portable = images_by_key(image_loader(photos, backend="portable", **common))
    assert sorted(dali) == sorted(portable)
    for key, image in dali.items():
        same = (image.float() - portable[key].float()).abs().mean().item()
        mirrored = (image.flip(-1).float() - portable[key].float()).abs().mean().item()
        assert same < DRAFT_TOLERANCE < mirrored, (key, same, mirrored)
        assert (image.float() - portable[key].float()).abs().max() <= DRAFT_MAX, key


def test_draft_decode_agrees_with_the_whole_window_decode(photos):
    """The draft measured against the undrafted decode (bit-exact with DALI's, above), so
    the tolerance holds in the no-DALI run too; and drafts do happen on these photos."""
    rng, drafted = np.random.default_rng(0), 0
    for path in sorted((photos.parent / "src").rglob("*.jpg"))[:8]:
        data = path.read_bytes()
        width, height = headers.header_size(data)
        for _ in range(4):
            w = augment.random_resized_crop(sample_rng(int(rng.integers(99)), 0, path.name),
                                            width, height, (0.08, 1.0), (3 / 4, 4 / 3))
            whole = resize.batch([decode_window(data, w, 64, draft=False)], [False], 64, True,
                                 None)[0].float()
            draft = resize.batch([decode_window(data, w, 64)], [False], 64, True, None)[0]
            drafted += draft_scale(w, 64) > 1
            diff = (whole - draft.float()).abs()
            assert diff.mean() < DRAFT_TOLERANCE and diff.max() <= DRAFT_MAX
    assert drafted >= 8


SIZES = [32, 48, 64, 128, 224]


def _agrees(got: torch.Tensor, want: torch.Tensor, what: object) -> torch.Tensor:
    diff = (got.float() - want.float()).abs()
    assert diff.mean() < DRAFT_TOLERANCE and diff.max() <= DRAFT_MAX, \
        (what, round(diff.mean().item(), 2), diff.max().item())
    return diff


@pytest.mark.dali
@pytest.mark.parametrize("size", SIZES)
def test_eval_pixels_agree_with_dalis_at_every_output_size(small_photos, size):
    """Photos of 128-416 px at 32-224 px, where backend="auto" takes the portable backend
    up to 64 px: every image within the draft tolerance of the DALI backend's (a draft that
    left the window barely `size` was up to 4-5 levels off on average and 50-85 at a pixel
    at 32-128)."""
    common = {"batch_size": 8, "size": size, "train": False, **OPTS}
    dali = images_by_key(image_loader(small_photos, backend="dali", **common))
    portable = images_by_key(image_loader(small_photos, backend="portable", **common))
    assert sorted(dali) == sorted(portable) and len(dali) == 24
    for key, image in dali.items():
        _agrees(portable[key], image, (key, size))


def _resized_by_definition(hwc: np.ndarray, size: int) -> torch.Tensor:
    """CHW uint8 `hwc` resized to size x size with the antialiased bilinear filter as
    torchvision and PIL define it: for each output pixel a triangle over the input pixel
    centres, centred on its own, as wide as the reduction on each side (one pixel where it
    enlarges), normalised where it leaves the window; both axes, rounded once."""
    def weights(n_in: int) -> np.ndarray:
        scale = n_in / size
        centres = (np.arange(size) + 0.5) * scale
        w = np.clip(1 - np.abs(np.arange(n_in)[None, :] + 0.5 - centres[:, None]) /
                    max(scale, 1.0), 0, None)
        return w / w.sum(axis=1, keepdims=True)

    rows, cols = weights(hwc.shape[0]), weights(hwc.shape[1])
    out = np.einsum("yh,hwc,xw->cyx", rows, hwc.astype(np.float64), cols, optimize=True)
    return torch.from_numpy(np.clip(np.rint(out), 0, 255).astype(np.uint8))


@pytest.mark.parametrize("size", SIZES)
def test_eval_pixels_agree_with_a_whole_decode_resized_by_definition(small_photos, size):
    """The same without DALI: against PIL's whole decode of each photo, the eval window cut
    from it and resized as `_resized_by_definition` says; where no draft applies, within the
    reference's rounding (DALI's pixels, test above); drafts do happen up to 64 px."""
    photos = {f"{p.parent.name}_{p.stem}": p.read_bytes()
              for p in (small_photos.parent / "src").rglob("*.jpg")}
    got = images_by_key(image_loader(small_photos, backend="portable", batch_size=8,
                                     size=size, train=False, **OPTS))
    assert sorted(got) == sorted(photos)
    drafted = 0
    for key, data in photos.items():
        with Image.open(io.BytesIO(data)) as img:
            whole = np.asarray(img.convert("RGB"))
        w = augment.center_crop(whole.shape[1], whole.shape[0], 0.875)
        want = _resized_by_definition(whole[w.y: w.y + w.height, w.x: w.x + w.width], size)
        diff = _agrees(got[key], want, (key, size))
        if draft_scale(w, size) == 1:
            assert diff.max() <= 1, (key, size)
        drafted += draft_scale(w, size) > 1
    assert drafted >= {32: 16, 48: 12, 64: 3}.get(size, 0), drafted


@pytest.mark.dali
@pytest.mark.parametrize("train", [True, False])
def test_clouds_equal_the_dali_backends_within_float_rounding(clouds, train):
    got = {}
    for backend in ("dali", "portable"):
        with pointcloud_loader(clouds, batch_size=8, num_points=64, voxels="count", grid=8,
                               train=train, backend=backend, **OPTS) as loader:
            got[backend] = {k: (b.points[i], b.voxels[i], int(b.label[i])) for b in loader
                            for i, k in enumerate(b.keys)}
    assert sorted(got["dali"]) == sorted(got["portable"]) and len(got["dali"]) == 18
    for key, (points, voxels, label) in got["dali"].items():
        other = got["portable"][key]
        torch.testing.assert_close(points, other[0], rtol=0, atol=1e-6)
        assert label == other[2] and (voxels - other[1]).abs().sum() <= 2  # a cell edge


@pytest.mark.dali
def test_an_old_state_without_a_backend_still_loads_into_a_dali_loader(shards):
    with image_loader(shards, batch_size=4, size=32, backend="dali", **OPTS) as loader:
        state = loader.state_dict()
        loader.load_state_dict({k: v for k, v in state.items() if k != "backend"})
        with pytest.raises(ValueError, match="saved by the 'portable' backend"):
            loader.load_state_dict({**state, "backend": "portable"})


# -- point clouds on their own --------------------------------------------------------------------

def test_cloud_math_is_graph_pys_normalize_scale_rotate_jitter():
    rng = np.random.default_rng(0)
    xyz = rng.normal(size=(50, 3)).astype(np.float32) * 3 + 7
    params = SampleParams(np.arange(49, -1, -2, dtype=np.int32), angle=30.0, scale=1.5,
                          noise=rng.normal(size=(25, 3)).astype(np.float32) * 0.01)
    points, finite, extent = transform(xyz, params, normalize=True)
    x = xyz.astype(np.float64)
    centre = (x.max(0) + x.min(0)) / 2
    unit = (x - centre) / np.linalg.norm(x - centre, axis=1).max()
    c, s = np.cos(np.radians(30)), np.sin(np.radians(30))
    turned = unit[params.index] * 1.5 @ np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]]).T
    np.testing.assert_allclose(points, turned + params.noise, atol=2e-6)
    assert finite == 0 and np.allclose(extent, x.max(0) - x.min(0))
    bad = xyz.copy()
    bad[3, 1] = np.nan
    assert np.isnan(transform(bad, params, normalize=True)[1])


def test_bad_clouds_are_skipped_with_the_dali_backends_reasons(tmp_path):
    writer = ShardWriter(tmp_path, "train", max_count=100, max_size=10**8)
    cloud = np.random.default_rng(1).normal(size=(40, 3)).astype(np.float32)
    bad = {"nan": np.where(np.arange(120).reshape(40, 3) == 7, np.nan, cloud),
           "flat": np.ones((40, 3), np.float32)}
    for key, points in [("good0", cloud), *bad.items(), ("good1", cloud * 2)]:
        out = io.BytesIO()
        np.save(out, points.astype(np.float32))
        writer.write({"__key__": key, "npy": out.getvalue(), "cls": b"0"})
    writer.finish()
    with pointcloud_loader([str(tmp_path / "train-000000.tar")], batch_size=4, num_points=16,
                           backend="portable", on_error="skip", **OPTS) as loader:
        keys = [k for b in loader for k in b.keys]
        assert loader.skip_counts() == {"non-finite": 1, "degenerate": 1}
    assert sorted(keys) == ["good0", "good1"]


# -- options, the log, text, imports ---------------------------------------------------------------

@pytest.mark.parametrize("options, match", [
    ({"backend": "portable", "decode": "gpu"}, "decode='gpu' needs DALI.*backend='portable'"),
    ({"backend": "portable", "reader": "dali"}, "reader='dali' needs DALI.*backend='portable'"),
    ({"backend": "portable", "resize_on": "dali"}, "resize_on='dali'.*portable backend"),
    ({"backend": "fast"}, "backend='fast': choose one of auto, dali, portable")])
@pytest.mark.backend
def test_options_the_portable_backend_cannot_honour_are_refused(shards, options, match):
    with pytest.raises(ValueError, match=match):
        image_loader(shards, batch_size=4, **{**OPTS, **options})


@pytest.fixture
def no_dali(monkeypatch: pytest.MonkeyPatch):
    """As if nvidia.dali did not import (the cached answers cleared before and after)."""
    readers._auto_backend.cache_clear()
    monkeypatch.setattr(readers, "dali_importable", lambda: False)
    yield
    readers._auto_backend.cache_clear()


def test_auto_takes_portable_without_dali_and_says_so_once(shards, no_dali, caplog):
    caplog.set_level(logging.INFO, logger="shardflow.loading.readers")
    for _ in range(2):
        with image_loader(shards, batch_size=4, size=32, **OPTS) as loader:
            assert loader.backend == "portable" and len(list(loader)) == 8
    said = [r.message for r in caplog.records if r.message.startswith("backend='auto'")]
    assert len(said) == 1 and "portable" in said[0] and "does not import" in said[0]
    with pytest.raises(ImportError, match="backend='dali'.*pip install nvidia-dali-cuda120"):
        image_loader(shards, batch_size=4, backend="dali", **OPTS)
    with pytest.raises(ValueError, match="decode='gpu'.*backend='auto': nvidia.dali does not"):
        image_loader(shards, batch_size=4, **{**OPTS, "decode": "gpu"})


@pytest.mark.parametrize("cuda, wheel", [("12.8", "nvidia-dali-cuda120"),
                                         ("13.0", "nvidia-dali-cuda130"),
                                         ("13.2", "nvidia-dali-cuda130"),
                                         (None, "nvidia-dali-cuda120"),  # a CPU-only torch
                                         ("11.8", "nvidia-dali-cuda120")])
def test_the_dali_wheel_follows_torchs_cuda(monkeypatch, cuda, wheel):
    """The install hint names the DALI build for torch's CUDA major version (CUDA 13 torch
    builds are current; the card's default stays nvidia-dali-cuda120), and says how to swap
    when it is not the default."""
    from shardflow import dali

    assert dali.wheel_for(cuda) == wheel
    monkeypatch.setattr(torch.version, "cuda", cuda)
    hint = dali.install_hint()
    assert hint.startswith(f"pip install {wheel}") == (wheel == dali.DEFAULT_WHEEL)
    if wheel != dali.DEFAULT_WHEEL:
        assert f"pip install {wheel}" in hint and "make dali-cuda13" in hint
        assert f"CUDA {cuda}" in hint


def test_text_streams_its_shards_on_the_portable_backend(tmp_path):
    out = _shards(tmp_path, "text", make_text_corpus(tmp_path / "docs", docs=40), 10)
    with text_loader(out, batch_size=4, seq_len=32, backend="portable", device="cpu",
                     use_tuning=False) as loader:
        batch = next(iter(loader))
        assert loader.reader == "stream" and loader.state_dict()["backend"] == "portable"
    assert batch.input_ids.shape == (4, 32) and batch.input_ids.dtype == torch.int64


@pytest.mark.backend
def test_train_tool_takes_the_backend_and_records_it(shards, tmp_path):
    run_tool("train", "--task", "image", "--data", shards, "--out", tmp_path / "run",
             "--steps", 2, "--batch-size", 8, "--size", 32, "--device", "cpu",
             "--precision", "fp32", "--backend", "portable", "--quiet", check=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["backend"] == "portable" and summary["steps"] == 2


def test_nothing_needs_dali_at_import():
    code = ("import shardflow, shardflow.image, shardflow.pointcloud, shardflow.text;"
            "import shardflow.trainers, shardflow.image.portable, shardflow.pointcloud.portable;"
            "import shardflow.tools.bench.image, shardflow.tools.bench.peers;"
            "import sys; assert not [m for m in sys.modules if m.startswith('nvidia.dali')]")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "nodali")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    tool = subprocess.run([sys.executable, str(ROOT / "tools" / "train.py"), "--help"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert tool.returncode == 0 and "--backend" in tool.stdout


@pytest.mark.backend
def test_the_no_dali_run_is_what_it_says():
    """In the Makefile's second run nvidia.dali must not import (else that run checks
    nothing); in the first it must wherever it is installed (else the DALI tests would all
    be skipped)."""
    blocked = any(Path(p).name == "nodali" for p in sys.path)
    try:
        importlib.metadata.version("nvidia-dali-cuda120")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert dali_available() == (installed and not blocked)
