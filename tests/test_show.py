"""`shardflow show` (tools/show_shards.py): grids of image, text and point-cloud shards
whose PNG decodes with the expected tiles, augmented pairs, statistics that count what the
shards hold, one sample by key or index, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_tool
from PIL import Image

from shardflow.access import view
from shardflow.builtin import make_image_folder, make_pointcloud_folder, make_text_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.tools import show_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("show")
    made = {"image": ("imagefolder", make_image_folder(root / "images", per_class=3, size=48)),
            "text": ("text", make_text_corpus(root / "docs", docs=25)),
            "pointcloud": ("pointcloud", make_pointcloud_folder(root / "pc", per_class=2,
                                                                points=80))}
    out = {}
    for modality, (kind, src) in made.items():
        convert(ConvertConfig(kind=kind, src=str(src), out=root / f"s-{modality}",
                              max_count=10, workers=1))
        out[modality] = root / f"s-{modality}"
    return out


def _tiles(png: Path) -> tuple[int, int]:
    """(columns, rows) of tiles the grid's size holds."""
    with Image.open(png) as img:
        img.load()
        w, h = img.size
    tw, th = view.TILE + 2, view.TILE + view.CAPTION + 2
    assert (w + 2) % tw == 0 and (h + 2) % th == 0, (w, h)
    return (w + 2) // tw, (h + 2) // th


@pytest.mark.parametrize("modality", ["image", "text", "pointcloud"])
def test_a_grid_decodes_with_its_tiles_and_different_samples(shards, modality, tmp_path):
    out = tmp_path / "grid.png"
    assert show_shards.main([str(shards[modality]), "--grid", "4x3", "--out", str(out)]) == 0
    assert _tiles(out) == (4, 3)
    pixels = np.asarray(Image.open(out).convert("RGB"))
    tiles = [pixels[r * 144: r * 144 + 128, c * 130: c * 130 + 128]
             for r in range(3) for c in range(4)]
    assert len({t.tobytes() for t in tiles}) == 12  # twelve samples, each drawn
    assert all(t.std() > 5 for t in tiles)  # none blank


def _shapes(root: Path) -> Path:
    """Shards of four images told apart by their shape (4:1, 4:3, 1:4, 1:1), each diagonal
    stripes of grey (no row or column of one a single value)."""
    for name, (w, h) in {"a": (64, 16), "b": (64, 48), "c": (16, 64), "d": (64, 64)}.items():
        y, x = np.mgrid[0:h, 0:w]
        grey = (70 + 50 * np.sin(2 * np.pi * (x + y) / 7)).round().astype(np.uint8)
        (root / "src" / name).mkdir(parents=True)
        Image.fromarray(np.stack([grey] * 3, axis=2)).save(root / "src" / name / f"{name}.png")
    convert(ConvertConfig(kind="imagefolder", src=str(root / "src"), out=root / "shards",
                          workers=1))
    return root / "shards"


def _drawn(tile: np.ndarray) -> tuple[slice, slice]:
    """The rows and columns of a tile's picture: where it is not the paper (pure white)."""
    ink = (tile != 255).any(axis=2)
    rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
    return slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1)


def _has_the_shape_of(tile: np.ndarray, image_tile: np.ndarray) -> bool:
    """Whether `tile` shows a picture of `image_tile`'s shape: nothing drawn outside its
    picture, and at least 90% of its height and width drawn (an op may blank an edge; over
    100 seeds of rand-m9-n2 on these images: all of it, and 75% at most for another's)."""
    rows, cols = _drawn(image_tile)
    outside = (tile != 255).any(axis=2)
    outside[rows, cols] = False
    got_rows, got_cols = _drawn(tile)
    spans = ((got_rows.stop - got_rows.start) / (rows.stop - rows.start),
             (got_cols.stop - got_cols.start) / (cols.stop - cols.start))
    return not outside.any() and min(spans) >= 0.9


def test_augmented_pairs_follow_each_image(tmp_path):
    shards = _shapes(tmp_path)
    out = tmp_path / "aug.png"
    show_shards.main([str(shards), "--grid", "4x2", "--augment", "rand-m9-n2", "--first",
                      "--out", str(out)])
    assert _tiles(out) == (4, 2)
    pixels = np.asarray(Image.open(out).convert("RGB"))
    tiles = [pixels[r * 144: r * 144 + 128, c * 130: c * 130 + 128]
             for r in range(2) for c in range(4)]
    images, augmented = tiles[0::2], tiles[1::2]
    # each image's second tile is that image augmented: its shape, no other image's
    assert [[_has_the_shape_of(a, i) for i in images] for a in augmented] == \
        [[n == m for m in range(4)] for n in range(4)]
    assert not any(np.array_equal(a, i) for a, i in zip(augmented, images, strict=True))
    again = tmp_path / "again.png"
    show_shards.main([str(shards), "--grid", "4x2", "--augment", "rand-m9-n2", "--first",
                      "--out", str(again)])
    assert np.array_equal(pixels, np.asarray(Image.open(again).convert("RGB")))  # same draws


def test_stats_count_what_the_shards_hold(shards, tmp_path):
    for modality, expect in (("image", "width"), ("text", "length"),
                             ("pointcloud", "points")):
        out = tmp_path / f"{modality}.png"
        show_shards.main([str(shards[modality]), "--stats", "--out", str(out)])
        Image.open(out).load()
        found = json.loads(out.with_suffix(".json").read_text())
        assert found["counted"] == found["samples"] and found["bad"] == {}
        assert sum(c for _, _, c in found[expect]["bins"]) == found["samples"]
        if modality != "text":
            assert sum(found["classes"].values()) == found["samples"]
    images = json.loads((tmp_path / "image.json").read_text())
    assert images["width"]["min"] == images["width"]["max"] == 48 and len(images["classes"]) == 10
    clouds = json.loads((tmp_path / "pointcloud.json").read_text())
    assert clouds["points"]["median"] == 80
    text = json.loads((tmp_path / "text.json").read_text())
    docs = sorted((shards["text"].parent / "docs").iterdir())
    lengths = [len(p.read_text(encoding="utf-8")) for p in docs]
    assert text["length"]["max"] == max(lengths) and text["length"]["min"] == min(lengths)
    limited = tmp_path / "some.png"
    show_shards.main([str(shards["text"]), "--stats", "--limit", "7", "--out", str(limited)])
    assert json.loads(limited.with_suffix(".json").read_text())["counted"] == 7


def test_one_sample_by_key_or_index_shows_its_members(shards, tmp_path, capsys):
    from shardflow import ShardDataset

    key = ShardDataset(shards["image"]).key(4)
    show_shards.main([str(shards["image"]), "--key", key, "--out", str(tmp_path / "one.png")])
    printed = capsys.readouterr().out
    assert f"index 4, key {key!r}" in printed and ".cls: 1 bytes" in printed
    assert "image: uint8 (48, 48, 3)" in printed and "label:" in printed
    Image.open(tmp_path / "one.png").load()
    show_shards.main([str(shards["text"]), "--at", "-1"])
    assert "text: 'Chronicle" in capsys.readouterr().out
    # --index is the index folder, as verify's and train's: a number is sent to --at
    with pytest.raises(ValueError, match="for sample 3, use --at 3"):
        show_shards.main([str(shards["text"]), "--index", "3"])


def test_an_unknown_key_or_a_bad_grid_is_a_usage_error(shards):
    proc = run_tool("show_shards", shards["image"], "--key", "nope")
    assert proc.returncode == 2 and "no sample with key 'nope'" in proc.stderr
    proc = run_tool("show_shards", shards["image"], "--grid", "8by8")
    assert proc.returncode == 2 and "COLSxROWS" in proc.stderr


def test_stats_of_shards_whose_every_sample_is_bad_say_so(tmp_path):
    """Not "no labels found" where every sample has a label and a broken image."""
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "bad-000000.tar")) as writer:
        for key in ("a", "b"):
            writer.write({"__key__": key, "jpg": b"not a jpeg", "cls": b"0"})
    run_tool("make_shards", "index", tmp_path, check=True)
    proc = run_tool("show_shards", tmp_path, "--stats", "--out", tmp_path / "s.png")
    assert proc.returncode == 2
    assert "every sample counted is bad (bad-image=2)" in proc.stderr


def test_a_captioned_sample_is_captioned_by_its_caption():
    from shardflow.tools.show_shards import _caption

    names = {0: "circle"}
    assert _caption({"__key__": "k", "label": 0, "txt": "a red circle"}, names) == "circle"
    assert _caption({"__key__": "k", "txt": " a dog on a sofa\n"}, names) == "a dog on a sofa"
    assert _caption({"__key__": "k", "txt": "  "}, names) == "k"
