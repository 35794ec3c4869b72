"""Tests for the built-in dataset generators in shardflow.builtin."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardflow.builtin import (
    make_image_folder,
    make_photo_corpus,
    make_pointcloud_folder,
    make_text_corpus,
)
from shardflow.builtin.images import CLASSES
from shardflow.builtin.pointclouds import SHAPES

# Small arguments per generator, so every test stays well under a second.
SMALL: dict[str, tuple[Callable[..., Path], dict[str, int]]] = {
    "images": (make_image_folder, {"per_class": 3, "size": 32}),
    "photos": (make_photo_corpus, {"count": 6, "classes": 3}),
    "text": (make_text_corpus, {"docs": 12}),
    "pointclouds": (make_pointcloud_folder, {"per_class": 3, "points": 128}),
}


def _contents(root: Path) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images") / "out", per_class=21, size=40)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_corpus(tmp_path_factory.mktemp("photos") / "out", count=12, classes=4)


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_text_corpus(tmp_path_factory.mktemp("text") / "out", docs=101)


@pytest.fixture(scope="module")
def clouds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pointcloud_folder(tmp_path_factory.mktemp("pc") / "out", per_class=26, points=256)


@pytest.mark.parametrize("name", SMALL)
def test_same_arguments_give_identical_bytes(name: str, tmp_path: Path) -> None:
    make, kwargs = SMALL[name]
    first = _contents(make(tmp_path / "a", **kwargs))
    second = _contents(make(tmp_path / "b", **kwargs))
    assert first and first == second


@pytest.mark.parametrize("name", SMALL)
def test_another_seed_changes_the_data(name: str, tmp_path: Path) -> None:
    make, kwargs = SMALL[name]
    first = _contents(make(tmp_path / "a", **kwargs, seed=0))
    second = _contents(make(tmp_path / "b", **kwargs, seed=1))
    assert first.keys() == second.keys() and first != second


@pytest.mark.parametrize("name", SMALL)
def test_refuses_a_non_empty_folder(name: str, tmp_path: Path) -> None:
    make, kwargs = SMALL[name]
    (tmp_path / "old.txt").write_text("keep me")
    with pytest.raises(ValueError, match=str(tmp_path)):
        make(tmp_path, **kwargs)
    assert [p.name for p in tmp_path.iterdir()] == ["old.txt"]


def test_accepts_an_existing_empty_folder(tmp_path: Path) -> None:
    out = make_text_corpus(tmp_path, docs=2)
    assert out == tmp_path and len(list(out.iterdir())) == 2


def test_image_folder_layout_and_formats(images: Path) -> None:
    assert sorted(p.name for p in images.iterdir()) == list(CLASSES)
    for name in CLASSES:
        files = sorted((images / name).iterdir())
        assert [p.stem for p in files] == [f"{name}_{i:05d}" for i in range(21)]
        assert [p.suffix for p in files] == [".png"] + [".jpg"] * 19 + [".png"]
        for path in files:
            with Image.open(path) as image:
                assert image.format == ("PNG" if path.suffix == ".png" else "JPEG")
                assert (image.mode, image.size) == ("RGB", (40, 40))


def _spectrum(path: Path) -> np.ndarray:
    # Log magnitude spectrum: blind to position (shift) and to which colour is foreground.
    pixels = np.asarray(Image.open(path), dtype=np.float64)
    spectrum = np.abs(np.fft.fft2(pixels - pixels.mean(axis=(0, 1)), axes=(0, 1))).sum(axis=-1)
    feature = np.log1p(spectrum).ravel()
    return (feature - feature.mean()) / feature.std()


def test_image_classes_are_learnable(images: Path) -> None:
    """Nearest class mean on spectra beats chance (10%) by far; random classes would not."""
    features = np.array([[_spectrum(p) for p in sorted((images / c).iterdir())] for c in CLASSES])
    train, held_out = features[:, 0::2], features[:, 1::2]
    means = train.mean(axis=1)
    distances = ((held_out[:, :, None, :] - means[None, None]) ** 2).sum(axis=-1)
    accuracy = (distances.argmin(axis=-1) == np.arange(len(CLASSES))[:, None]).mean()
    assert accuracy > 0.4


def test_photo_corpus_looks_like_imagenet(photos: Path) -> None:
    files = sorted(photos.rglob("*.jpg"))
    assert sorted(p.name for p in photos.iterdir()) == [f"class_{c:03d}" for c in range(4)]
    assert len(files) == 12 and all(len(list(d.iterdir())) == 3 for d in photos.iterdir())
    for path in files:
        assert 40_000 <= path.stat().st_size <= 110_000, path
        with Image.open(path) as image:
            assert (image.format, image.mode) == ("JPEG", "RGB")
            long_side, short_side = max(image.size), min(image.size)
        assert 350 <= long_side <= 500 and 0.74 <= short_side / long_side <= 1.0


def test_photo_corpus_is_textured(photos: Path) -> None:
    # Flat shapes have near-zero neighbour differences almost everywhere; photos do not.
    for path in sorted(photos.rglob("*.jpg"))[:3]:
        gray = np.asarray(Image.open(path).convert("L"), dtype=np.float64)
        assert np.mean(np.abs(np.diff(gray, axis=1)) > 2) > 0.5


def test_text_corpus_is_utf8_with_some_non_ascii(texts: Path) -> None:
    files = sorted(texts.iterdir())
    assert [p.name for p in files] == [f"doc_{i:05d}.txt" for i in range(101)]
    docs = [p.read_bytes().decode("utf-8") for p in files]
    assert all(len(doc.split()) >= 10 for doc in docs)
    non_ascii = [i for i, doc in enumerate(docs) if not doc.isascii()]
    assert non_ascii == [0, 50, 100]
    assert "café" in docs[50] and "naïve" in docs[50]


def _cross_entropies(train: bytes, test: bytes) -> tuple[float, float]:
    """Bits per byte of ``test`` under unigram and bigram byte models fitted on ``train``."""
    a, b = np.frombuffer(train, np.uint8), np.frombuffer(test, np.uint8)
    unigram = np.bincount(a, minlength=256) + 0.1
    bigram = np.zeros((256, 256)) + 0.1
    np.add.at(bigram, (a[:-1], a[1:]), 1.0)
    uni = -np.log2(unigram[b] / unigram.sum()).mean()
    bi = -np.log2(bigram[b[:-1], b[1:]] / bigram[b[:-1]].sum(axis=1)).mean()
    return float(uni), float(bi)


def test_text_has_structure_a_model_can_learn(texts: Path) -> None:
    """A byte bigram model beats the unigram entropy on held-out docs; shuffled bytes would not."""
    docs = [p.read_bytes() for p in sorted(texts.iterdir())]
    unigram, bigram = _cross_entropies(b"".join(docs[1:80]), b"".join(docs[80:100]))
    assert bigram < unigram - 1.0


def _load_cloud(path: Path) -> np.ndarray:
    if path.suffix == ".xyz":
        return np.loadtxt(path, dtype=np.float32, ndmin=2)
    return np.load(path, allow_pickle=False)


def test_point_clouds_layout_and_values(clouds: Path) -> None:
    assert sorted(p.name for p in clouds.iterdir()) == sorted(SHAPES)
    for name in SHAPES:
        files = sorted((clouds / name).iterdir())
        assert [p.name for p in files][:2] == [f"{name}_00000.xyz", f"{name}_00001.npy"]
        assert [p.suffix for p in files].count(".xyz") == 2 and len(files) == 26
        for path in files:
            cloud = _load_cloud(path)
            assert cloud.dtype == np.float32 and cloud.shape == (256, 3)
            assert np.isfinite(cloud).all() and np.ptp(cloud, axis=0).min() > 0.3
            assert np.abs(cloud).max() < 3.0


def test_xyz_holds_the_same_kind_of_cloud_as_npy(clouds: Path) -> None:
    xyz = _load_cloud(clouds / "sphere" / "sphere_00000.xyz")
    npy = _load_cloud(clouds / "sphere" / "sphere_00001.npy")
    assert abs(np.ptp(xyz, axis=0).mean() - np.ptp(npy, axis=0).mean()) < 0.6
