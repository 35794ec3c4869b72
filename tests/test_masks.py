"""Images with segmentation masks: make_shards manifest --mask-column, verify_shards and
image_loader(targets={"mask": "seg.png"}) agree on what a valid mask is, and every crop,
turn, flip and geometric op moves a mask exactly as it moves its image."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_tool
from PIL import Image

from shardflow import image_loader, ops
from shardflow.errors import DataError

SIZE = 32


def _scene(seed: int, width: int = 72, height: int = 56) -> tuple[np.ndarray, np.ndarray]:
    """An image of two flat shapes on a dark ground, and its true mask: 1 under the disc, 2
    under the box, 0 elsewhere (levels far apart, so a threshold reads the mask back)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:height, :width]
    cx, cy, r = rng.integers(15, width - 15), rng.integers(15, height - 15), rng.integers(8, 14)
    disc = (xx - cx) ** 2 + (yy - cy) ** 2 < r * r
    x0, y0 = rng.integers(0, width - 20), rng.integers(0, height - 16)
    box = (xx >= x0) & (xx < x0 + 18) & (yy >= y0) & (yy < y0 + 14) & ~disc
    mask = np.where(disc, 1, np.where(box, 2, 0)).astype(np.uint8)
    image = np.stack([np.choose(mask, c) for c in ([20, 230, 40], [20, 60, 220],
                                                   [30, 40, 200])], axis=-1).astype(np.uint8)
    return image, mask


def mask_of(images: torch.Tensor) -> torch.Tensor:
    """The mask read back from uint8 images (N, 3, H, W): red high is the disc, green high
    the box. Black (filled by a warp) reads as 0, as the warped mask is filled."""
    r, g = images[:, 0].int(), images[:, 1].int()
    return torch.where(r > 130, 1, torch.where(g > 130, 2, 0)).to(torch.uint8)


def _png(array: np.ndarray, mode: str | None = None) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array, mode).save(out, format="PNG") if mode != "P" else \
        _palette(array).save(out, format="PNG")
    return out.getvalue()


def _palette(mask: np.ndarray) -> Image.Image:
    img = Image.fromarray(mask, "L").convert("P")
    img.putpalette([0, 0, 0, 128, 0, 0, 0, 128, 0] + [0] * (256 * 3 - 9))
    img.putdata(mask.flatten().tolist())  # the indices are the labels (VOC style)
    return img


def _write_corpus(root: Path, count: int = 12) -> Path:
    """Images (JPEG and PNG) and masks (L, P, BMP, 16-bit PNG), with a manifest."""
    rows = []
    for i in range(count):
        image, mask = _scene(i)
        img_path, mask_path = root / f"img{i:02d}.{'png' if i % 4 == 3 else 'jpg'}", None
        exif = Image.Exif()
        if i in (5, 6):  # phone photos stored sideways: the mask is aligned with the pixels
            exif[0x0112] = 6 if i == 5 else 3  # as stored, both turned upright by the loader
        Image.fromarray(image).save(img_path, quality=98, exif=exif)
        kind = ("L", "P", "BMP", "I;16")[i % 4]
        if kind == "BMP":
            mask_path = root / f"img{i:02d}_mask.bmp"
            Image.fromarray(mask, "L").save(mask_path)
        else:
            mask_path = root / f"img{i:02d}_mask.png"
            data = mask.astype(np.uint16) * 1000 if kind == "I;16" else mask
            mask_path.write_bytes(_png(data, kind if kind != "I;16" else None))
        rows.append({"path": img_path.name, "label": i % 3, "mask": mask_path.name})
    with open(root / "list.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["path", "label", "mask"])
        writer.writeheader()
        writer.writerows(rows)
    return root / "list.csv"


@pytest.fixture(scope="module")
def masked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("masks")
    (root / "src").mkdir()
    listing = _write_corpus(root / "src")
    run_tool("make_shards", "manifest", listing, root / "out", "--mask-column", "mask",
             "--max-count", 4, check=True)
    return root / "out"


def _members(out: Path) -> dict[str, bytes]:
    found = {}
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                found[m.name] = t.extractfile(m).read()  # type: ignore[union-attr]
    return found


def test_masks_are_stored_losslessly_as_png_and_verify_passes(masked):
    members = _members(masked)
    masks = {k: v for k, v in members.items() if k.endswith(".seg.png")}
    assert len(masks) == 12
    for name, data in masks.items():
        with Image.open(io.BytesIO(data)) as img:
            assert img.format == "PNG" and img.mode in ("L", "P", "I;16")
            values = set(np.unique(np.asarray(img)).tolist())
            assert values <= {0, 1, 2} or values <= {0, 1000, 2000}, name
    proc = run_tool("verify_shards", masked, "--jobs", 1)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _convert(tmp_path: Path, broken: dict[int, bytes | Image.Image], *args: object):
    (tmp_path / "src").mkdir(parents=True)
    listing = _write_corpus(tmp_path / "src", count=4)
    for i, what in broken.items():
        path = tmp_path / "src" / f"img{i:02d}_mask.png"
        if isinstance(what, Image.Image):
            what.save(path, format="JPEG" if what.mode == "RGB" else "PNG")
        else:
            path.write_bytes(what)
        rows = list(csv.DictReader(open(listing)))
        rows[i]["mask"] = path.name
        with open(listing, "w", newline="") as f:
            writer = csv.DictWriter(f, ["path", "label", "mask"])
            writer.writeheader()
            writer.writerows(rows)
    return run_tool("make_shards", "manifest", listing, tmp_path / "out", "--mask-column",
                    "mask", *args)


@pytest.mark.parametrize("broken, reason", [
    (_png(np.zeros((20, 30), np.uint8)), "mask-size"),
    (_png(np.zeros((56, 72, 3), np.uint8)), "bad-mask"),  # colours, not labels
    (Image.fromarray(np.zeros((56, 72, 3), np.uint8)), "bad-mask"),  # a JPEG
    (b"not an image", "bad-mask"),
], ids=["other-size", "colours", "jpeg", "not-an-image"])
def test_a_bad_mask_is_refused_naming_it_or_skipped_and_counted(tmp_path, broken, reason):
    proc = _convert(tmp_path, {1: broken})
    assert proc.returncode != 0 and reason in proc.stderr and "img01_mask.png" in proc.stderr
    proc = _convert(tmp_path / "again", {1: broken}, "--on-error", "skip")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "again" / "out" / "manifest.json").read_text())
    assert manifest["total_samples"] == 3 and manifest["skipped_counts"] == {reason: 1}
    assert manifest["skipped"][0]["key"] == "img01"


def test_a_manifest_row_without_a_mask_is_named(tmp_path):
    listing = _write_corpus(tmp_path, count=3)
    rows = list(csv.DictReader(open(listing)))
    rows[2]["mask"] = ""
    with open(listing, "w", newline="") as f:
        writer = csv.DictWriter(f, ["path", "label", "mask"])
        writer.writeheader()
        writer.writerows(rows)
    proc = run_tool("make_shards", "manifest", listing, tmp_path / "out", "--mask-column",
                    "mask")
    assert proc.returncode != 0 and "row 3 has no mask" in proc.stderr


def _shard_with(tmp_path: Path, members: dict[str, bytes]) -> Path:
    """A shard written with tarfile (as GNU tar would), no index: the streaming reader."""
    out = tmp_path / "hand"
    out.mkdir()
    with tarfile.open(out / "hand-000000.tar", "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out / "hand-000000.tar"


@pytest.mark.backend
def test_verify_and_the_loader_refuse_a_mask_of_another_size_naming_its_key(tmp_path):
    image, mask = _scene(0)
    jpg = io.BytesIO()
    Image.fromarray(image).save(jpg, format="JPEG")
    members = {"a.jpg": jpg.getvalue(), "a.cls": b"0", "a.seg.png": _png(mask),
               "b.jpg": jpg.getvalue(), "b.cls": b"1", "b.seg.png": _png(mask[:, :40])}
    shard = _shard_with(tmp_path, members)
    proc = run_tool("verify_shards", shard, "--jobs", 1)
    assert proc.returncode == 1 and "mask-size" in proc.stdout + proc.stderr
    assert "b" in proc.stdout + proc.stderr
    opts = {"batch_size": 2, "size": SIZE, "device": "cpu", "threads": 1, "backend": "portable",
            "use_tuning": False, "num_classes": 2, "targets": {"mask": "seg.png"}}
    with pytest.raises(DataError) as info, image_loader([str(shard)], **opts) as loader:
        list(loader)
    assert info.value.key == "b" and info.value.reason == "mask-size"
    with image_loader([str(shard)], on_error="skip", **opts) as loader:
        batches = list(loader)
        assert loader.skip_counts() == {"mask-size": 1}
    assert [b.keys for b in batches] == [["a"]]


BACKENDS = [pytest.param("dali", "dali", marks=pytest.mark.dali),
            pytest.param("stream", "dali", marks=pytest.mark.dali),
            ("stream", "portable")]


def _agreement(batch) -> float:  # type: ignore[no-untyped-def]
    """The share of pixels where the mask read back from the image is the loaded mask,
    leaving out a pixel's width along every edge of a shape (resampling blends there)."""
    read, loaded = mask_of(batch.image), batch.targets["mask"]
    edge = torch.zeros_like(loaded, dtype=torch.bool)
    for dy, dx in ((0, 1), (1, 0), (0, -1), (-1, 0)):
        edge |= loaded != loaded.roll((dy, dx), dims=(1, 2))
    return (read == loaded)[~edge].float().mean().item()


@pytest.mark.parametrize("reader, backend", [
    *BACKENDS, pytest.param("dali", "dali+resize", marks=pytest.mark.dali)])
@pytest.mark.backend
def test_crop_and_flip_move_the_mask_with_the_image(masked, reader, backend):
    """dali+resize: the image resized, turned and flipped in the graph (resize_on="dali"),
    its mask by resize.py."""
    if backend.startswith("dali"):
        pytest.importorskip("nvidia.dali")
    resize_on = "dali" if backend == "dali+resize" else "auto"
    with image_loader(masked, batch_size=4, size=SIZE, device="cpu", threads=1, seed=1,
                      reader=reader, backend=backend.split("+")[0], use_tuning=False,
                      resize_on=resize_on,
                      crop_scale=(0.3, 1.0), targets={"mask": "seg.png"}) as loader:
        batches = list(loader)
    assert sum(len(b) for b in batches) == 12
    for b in batches:
        m = b.targets["mask"]
        assert m.shape == (len(b), SIZE, SIZE) and m.dtype == torch.int64  # cross_entropy's
        assert set(torch.unique(m).tolist()) <= {0, 1, 2, 1000, 2000}  # 16-bit ones x1000
        b.targets["mask"] = torch.where(m >= 1000, m // 1000, m).to(torch.uint8)
        assert _agreement(b) > 0.99


GEOMETRIC = [ops.Flip(p=1.0), ops.Affine(degrees=25, translate=(0.15, 0.1), scale=(0.8, 1.2),
                                         shear=(-10, 10)),
             ops.Rotate(40)]
POLICIES = [ops.RandAugment(2, 12), ops.TrivialAugmentWide(), ops.AutoAugment("imagenet")]


# Steps after which the colours still read the mask back (mask_of): the others (solarize,
# invert, posterize, equalize...) remap the colours themselves.
READABLE = {"Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate",
            "Sharpness"}


def _readable(op: ops.Op, param: object) -> bool:
    """Whether a policy's draw keeps the colours readable by mask_of."""
    return all(s is None or s[0] in READABLE for s in op.steps(param))  # type: ignore[attr-defined]


@pytest.mark.parametrize("op", GEOMETRIC, ids=lambda op: type(op).__name__)
@pytest.mark.backend
def test_geometric_ops_warp_the_mask_as_the_image(masked, op):
    """In the loader: a mask read back from the augmented image is the loaded (warped) mask,
    up to the edges; the ops move most masks (else the test would say nothing)."""
    with image_loader(masked, batch_size=4, size=SIZE, device="cpu", threads=1, seed=1,
                      backend="portable", use_tuning=False, targets={"mask": "seg.png"},
                      crop_scale=(0.6, 1.0),
                      augment=[op, ops.ColorJitter(0.1, 0.1, 0.0, 0.0)]) as loader:
        batches = list(loader)
    with image_loader(masked, batch_size=4, size=SIZE, device="cpu", threads=1, seed=1,
                      backend="portable", use_tuning=False, crop_scale=(0.6, 1.0),
                      targets={"mask": "seg.png"}) as loader:
        plain = {k: b.targets["mask"][i] for b in loader for i, k in enumerate(b.keys)}
    moved = 0
    for b in batches:
        m = b.targets["mask"]
        moved += sum(not torch.equal(m[i], plain[k]) for i, k in enumerate(b.keys))
        b.targets["mask"] = torch.where(m >= 1000, m // 1000, m).to(torch.uint8)
        assert _agreement(b) > 0.98
    # (a crop of background alone, or a symmetric one, looks the same moved)
    assert moved >= 10


@pytest.mark.parametrize("op", POLICIES, ids=lambda op: type(op).__name__)
def test_policies_warp_masks_with_their_geometric_steps(op):
    """ops.apply(..., masks=) over 96 scenes: on every sample whose drawn steps keep the
    colours readable, the mask read back is the warped mask up to the edges; the colour
    steps leave masks alone (those samples' masks are only moved by geometric steps)."""
    scenes = [_scene(100 + i, 48, 48) for i in range(96)]
    images = torch.stack([torch.from_numpy(im).permute(2, 0, 1) for im, _ in scenes])
    masks = torch.stack([torch.from_numpy(m) for _, m in scenes])[:, None]
    keys = [f"s{i}" for i in range(96)]
    out, warped = ops.apply([op], images, ops.sample_rngs(0, 0, keys), masks=masks)
    params = [op.draw(r) for r in ops.sample_rngs(0, 0, keys)]
    checked = moved = 0
    for i, param in enumerate(params):
        steps = [s for s in op.steps(param) if s is not None]  # type: ignore[attr-defined]
        if not any(s[0] in GEOMETRIC_STEPS for s in steps):
            assert torch.equal(warped[i], masks[i])  # nothing moved its pixels
        if not _readable(op, param):
            continue
        checked += 1
        moved += not torch.equal(warped[i], masks[i])
        one = type("B", (), {})()
        one.image, one.targets = out[i:i + 1], {"mask": warped[i]}
        assert _agreement(one) > 0.98, (i, steps)
    assert checked >= 10 and moved >= 5


GEOMETRIC_STEPS = {"ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"}


@pytest.mark.backend
def test_colour_ops_and_erasing_leave_the_mask_as_it_is(masked):
    kwargs = {"batch_size": 4, "size": SIZE, "device": "cpu", "threads": 1, "seed": 1,
              "backend": "portable", "use_tuning": False, "targets": {"mask": "seg.png"}}
    with image_loader(masked, **kwargs) as loader:
        plain = list(loader)
    recipe = [ops.ColorJitter(0.4, 0.4, 0.4, 0.1), ops.Equalize(1.0), ops.Solarize(128, 1.0),
              ops.GaussianBlur(3), ops.RandomErasing(p=1.0)]
    with image_loader(masked, augment=recipe, **kwargs) as loader:
        coloured = list(loader)
    for a, b in zip(plain, coloured, strict=True):
        assert torch.equal(a.targets["mask"], b.targets["mask"])
        assert not torch.equal(a.image, b.image)


def test_ops_apply_warps_masks_outside_a_loader(masked):
    """ops.apply(..., masks=): the same draws for images and masks, per op and in chunks;
    a 16-bit label map keeps its values."""
    image, mask = _scene(3, 64, 64)
    images = torch.from_numpy(image).permute(2, 0, 1)[None].repeat(6, 1, 1, 1)
    masks = torch.from_numpy(mask.astype(np.int32) * 1000)[None, None].repeat(6, 1, 1, 1)
    keys = [f"k{i}" for i in range(6)]
    recipe = [ops.RandomResizedCrop(48, scale=(0.3, 1.0)), ops.Rotate(30), ops.Flip()]
    out, warped = ops.apply(recipe, images, ops.sample_rngs(0, 0, keys), masks=masks)
    assert warped.dtype == torch.int32 and warped.shape == (6, 1, 48, 48)
    assert set(torch.unique(warped).tolist()) <= {0, 1000, 2000}
    read = mask_of(out)
    loaded = (warped[:, 0] // 1000).to(torch.uint8)
    assert (read == loaded).float().mean() > 0.97
    alone = ops.apply(recipe, images, ops.sample_rngs(0, 0, keys))
    assert torch.equal(alone, out)  # masks change no image draw
    with pytest.raises(ValueError, match="need \\(N, K, H, W\\)"):
        ops.apply(recipe, images, ops.sample_rngs(0, 0, keys), masks=masks[:, 0])


def test_one_bit_masks_are_labels_0_and_1_and_targets_name_a_member_once():
    """A 1-bit PNG mask reads as 0/1 (PIL's convert("L") would give 255, the usual ignore
    index), converted or not; two targets naming one member are refused."""
    from shardflow.samples import masks

    _, mask = _scene(0)
    one_bit = io.BytesIO()
    Image.fromarray(mask > 0).save(one_bit, format="PNG")
    assert Image.open(io.BytesIO(one_bit.getvalue())).mode == "1"
    read = masks.read_mask(one_bit.getvalue(), (72, 56))
    assert set(np.unique(read).tolist()) == {0, 1} and (read == (mask > 0)).all()
    bmp = io.BytesIO()
    Image.fromarray(mask > 0).save(bmp, format="BMP")
    stored = masks.prepare_mask(bmp.getvalue(), (72, 56))
    assert set(np.unique(masks.read_mask(stored, (72, 56))).tolist()) == {0, 1}
    from shardflow.image.config import ImageConfig

    with pytest.raises(ValueError, match="named twice"):
        ImageConfig(batch_size=2, targets={"mask": "seg.png", "again": "seg.png"})
