"""pipeline/image/rows.py: a JPEG decoded down to the window's last row (and the resize's
reach), not below, gives the very pixels of a full decode; a file cut short is refused as
before."""

from __future__ import annotations

import io
import logging
import math

import numpy as np
import pytest
from PIL import Image

from shardflow.image.augment import CropParams
from shardflow.image.portable import decode_window
from shardflow.image.rows import load_rows, resized_rows
from shardflow.samples.headers import scan_start


def jpeg(h: int, w: int, mode: str = "RGB", seed: int = 0, **options) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    pixels = np.stack([128 + 100 * np.sin(x / 50 + c) * np.cos(y / 37) for c in range(3)], -1)
    pixels += rng.normal(0, 20, (h, w, 3))
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).convert(mode).save(
        out, "JPEG", **options)
    return out.getvalue()


KINDS = {
    "4:2:0": lambda: jpeg(900, 1200, quality=90),
    "4:4:4": lambda: jpeg(700, 900, quality=90, subsampling=0),
    "progressive": lambda: jpeg(900, 1200, quality=85, progressive=True),
    "gray": lambda: jpeg(700, 600, mode="L"),
    "cmyk": lambda: jpeg(500, 640, mode="CMYK"),
    "odd size": lambda: jpeg(333, 517, quality=75),
}


def windows(width: int, height: int, count: int, seed: int) -> list[CropParams]:
    """Random-resized-crop windows (scale 0.08-1, ratio 3/4-4/3), and the corners."""
    rng = np.random.default_rng(seed)
    out = [CropParams(0, 0, width, height, False), CropParams(0, height - 16, 16, 16, False)]
    while len(out) < count:
        area = width * height * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < w <= width and 0 < h <= height:
            out.append(CropParams(int(rng.integers(0, width - w + 1)),
                                  int(rng.integers(0, height - h + 1)), w, h, False))
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_cut_gives_the_pixels_of_a_full_decode(kind: str) -> None:
    data = KINDS[kind]()
    width, height = Image.open(io.BytesIO(data)).size
    for window in windows(width, height, 40, seed=len(kind)):
        for size in (32, 224):  # drafted (1/2..1/8) and full-scale crops both
            cut = decode_window(data, window, size, cut=True)
            whole = decode_window(data, window, size, cut=False)
            assert cut.shape == whole.shape and np.array_equal(cut, whole), (window, size)


def test_only_the_rows_asked_for_are_decoded() -> None:
    data = KINDS["4:2:0"]()
    with Image.open(io.BytesIO(data)) as img:
        assert load_rows(img, 100, data) is True
        assert img.size == (1200, 100)
        with Image.open(io.BytesIO(data)) as full:
            assert np.array_equal(np.asarray(img), np.asarray(full)[:100])
    with Image.open(io.BytesIO(data)) as img:
        assert load_rows(img, 900, data) is None  # every row: nothing to cut
    png = io.BytesIO()
    Image.new("RGB", (64, 64)).save(png, "PNG")
    with Image.open(png) as img:
        assert load_rows(img, 10, png.getvalue()) is None


def test_the_resize_reach_is_inside_the_image() -> None:
    assert resized_rows((0, 0, 448, 448), 224, 1000) == math.ceil(448 + 3) + 1
    assert resized_rows((0, 500, 100, 990), 224, 1000) == 995  # 990 + 3.19, rounded up, + 1
    assert resized_rows((0, 500, 100, 998), 224, 1000) == 1000  # the last row at most


def mpo() -> bytes:
    """A phone's MPO: the photo, then a second image (a depth map, say) after its end."""
    out = io.BytesIO()
    photo = Image.open(io.BytesIO(KINDS["4:2:0"]()))
    photo.save(out, "MPO", save_all=True, append_images=[photo.resize((120, 90))], quality=90,
               comment=jpeg(60, 80))
    return out.getvalue()


@pytest.mark.parametrize("kind", ["plain", "thumbnail", "mpo"])
@pytest.mark.parametrize("keep", [1 / 3, 1 / 2, 0.98])
def test_a_file_cut_short_is_refused_as_before(keep: float, kind: str) -> None:
    """Also where a JPEG inside the header (a camera's thumbnail; here in a comment) has an
    end-of-image marker of its own, and in an MPO cut inside its first image: the photo's
    scan has none all the same."""
    data = {"plain": KINDS["4:2:0"], "mpo": mpo,
            "thumbnail": lambda: jpeg(900, 1200, quality=90, comment=jpeg(60, 80))}[kind]()
    if kind == "mpo":  # cut inside the photo, the second image gone with the rest
        data = data[:data.index(b"\xff\xd9", scan_start(data)) + 2]
    assert (data.index(b"\xff\xd9") < data.rindex(b"\xff\xda")) == (kind != "plain")
    short = data[: int(len(data) * keep)]
    window = CropParams(0, 0, 300, 200, False)  # above the cut: the rows are all there
    with pytest.raises(OSError, match="truncated"):
        decode_window(short, window, 224, cut=False)
    with pytest.raises(OSError, match="truncated"):
        decode_window(short, window, 224, cut=True)


def test_rows_that_never_come_fall_back_to_the_whole_decode() -> None:
    """A progressive file cut short never outputs a row (libjpeg reads every scan first):
    the sentinel row stays, and the whole decode raises, as before."""
    data = KINDS["progressive"]()
    short = data[: len(data) // 2] + b"\xff\xd9"  # an end marker, but scans missing
    window = CropParams(0, 0, 300, 200, False)
    try:
        whole = decode_window(short, window, 224, cut=False)
    except OSError:
        with pytest.raises(OSError):
            decode_window(short, window, 224, cut=True)
    else:  # libjpeg filled the missing scans in (a warning): then both give the same pixels
        assert np.array_equal(decode_window(short, window, 224, cut=True), whole)


def side_corpora(root) -> dict[str, object]:
    """Shards of 3 photos whose median shorter side is 4 x 224 ("large") and 8 px less."""
    from shardflow.convert import ConvertConfig, convert

    for name, side in (("large", 4 * 224), ("small", 4 * 224 - 8)):
        folder = root / name / "class_0"
        folder.mkdir(parents=True)
        for i in range(3):
            (folder / f"{i}.jpg").write_bytes(jpeg(side, side + 100 * i, seed=i))
        convert(ConvertConfig(kind="imagefolder", src=str(root / name),
                              out=str(root / f"{name}-shards"), workers=1, max_count=2))
    return {name: root / f"{name}-shards" for name in ("large", "small")}


@pytest.mark.backend
@pytest.mark.dali
def test_auto_runs_the_portable_backend_on_large_photos_only(tmp_path) -> None:
    from shardflow import image_loader
    from shardflow.image import choose

    shards = side_corpora(tmp_path)
    untuned = {"tuning_file": tmp_path / "none.json"}
    with image_loader(shards["large"], batch_size=2, **untuned) as loader:
        assert loader.backend == "portable"
        assert len(next(iter(loader))) == 2
    with image_loader(shards["small"], batch_size=2, **untuned) as loader:
        assert loader.backend == "dali"  # shorter sides below 4 x 224
    for asked in ({"backend": "dali"}, {"reader": "dali"}, {"size": 256}):
        with image_loader(shards["large"], batch_size=2, **untuned, **asked) as loader:
            assert loader.backend == "dali", asked
    assert choose.shorter_sides(loader.source) == [896, 896, 896]


def test_the_split_moves_only_where_a_measurement_contradicts_it() -> None:
    from shardflow.image.choose import LARGE, split

    def point(ratio, dali, portable):
        return {"side_ratio": ratio, "dali": dali, "portable": portable}

    assert split([]) == LARGE
    # the built-in corpora's ratios (about 1.66 and 13.7) agree with the default: kept
    assert split([point(1.66, 1500, 900), point(13.7, 60, 130)]) == LARGE
    assert split([point(2, 1500, 900)]) == split([point(5, 60, 130)]) == LARGE
    assert split([point(6, 90, 80)]) == pytest.approx(6 * math.sqrt(2))  # DALI won above it
    assert split([point(2, 800, 900)]) == pytest.approx(math.sqrt(2))  # PIL won below it
    assert split([point(2, 900, 800), point(3, 80, 90)]) == pytest.approx(math.sqrt(6))
    # a portable win below a DALI win (noise) does not pull the line under DALI's win
    assert split([point(3, 100, 120), point(5, 100, 90), point(10, 60, 130)]) == \
        pytest.approx(math.sqrt(50))
    assert split([{"side_ratio": 9}, point(-1, 1, 2), {"dali": "x"}]) == LARGE  # hand-edited
    assert split(None) == split({"x": 1}) == LARGE  # type: ignore[arg-type]
    assert split([point("6", "90", "80")]) == split([point(6, 90, 80)])  # numbers as text
    assert split([point(6, float("nan"), 80), point(6, float("inf"), 80)]) == LARGE


def test_the_size_probe_reads_long_headers_and_passes_over_a_bad_sample(tmp_path) -> None:
    """A 100 KB ICC profile takes a photo's header past 64 KB; a sample that says no size is
    left out, and the others still decide."""
    from shardflow.convert import ConvertConfig, convert
    from shardflow.image import choose
    from shardflow.loading.shardlist import resolve_source

    folder = tmp_path / "photos" / "class_0"
    folder.mkdir(parents=True)
    for i in range(4):
        (folder / f"{i}.jpg").write_bytes(jpeg(900, 1000, seed=i, icc_profile=bytes(100_000)))
    convert(ConvertConfig(kind="imagefolder", src=str(tmp_path / "photos"),
                          out=str(tmp_path / "shards"), workers=1, max_count=2))
    source = resolve_source(str(tmp_path / "shards"))
    assert choose.shorter_sides(source) == [900] * 4

    class OneBad:
        def raw(self, i):
            if i == 1:
                raise ValueError("unreadable")
            return {"jpg": b"not an image"} if i == 2 else {"jpg": jpeg(300, 500)}

    sides = [choose._shorter_side(OneBad(), i, ("jpg",)) for i in range(4)]
    assert sides == [300, None, None, 300]


@pytest.mark.backend
@pytest.mark.dali
def test_auto_follows_the_tuning_files_split_and_not_its_dali_reader(tmp_path, caplog
                                                                      ) -> None:
    """The split --tune measured moves the line; a reader or resize_on the tuning file chose
    for DALI does not keep DALI on large photos (the user did not ask for them), and the
    portable backend gets its own tuned threads and prefetch; options the caller gave stay.
    The log says which split chose, and the tuned choices used, once."""
    from shardflow import image_loader
    from shardflow.loading.tuning import Tuning

    shards = side_corpora(tmp_path)
    path = tmp_path / "tuning.json"

    def tuned(split, portable=None):
        Tuning("cpu", "dali", 3, 4, 100.0, resize_on="dali", backend_split=split,
               portable=portable).save(path)

    def backend(name, **options):
        with image_loader(shards[name], batch_size=2, device="cpu", tuning_file=path,
                          **options) as loader:
            return loader.backend, loader.reader, loader.cfg.threads, loader.cfg.prefetch

    tuned([], portable={"threads": 1, "prefetch": 3})
    with caplog.at_level(logging.INFO, logger="shardflow"):
        assert backend("large") == ("portable", "stream", 1, 3)
    said = [r.getMessage() for r in caplog.records]
    tuned_lines = [m for m in said if "from the tuning file" in m]
    assert len(tuned_lines) == 1, said  # the portable choices only, not DALI's before them
    assert tuned_lines[0].startswith(
        f"image loader: {{'decode': 'cpu', 'threads': 1, 'prefetch': 3}} from the tuning "
        f"file {path} "), said
    assert any("4x output 224 or more, the split of this machine's tuning file" in m
               for m in said), said
    assert backend("large", threads=2) == ("portable", "stream", 2, 3)  # the caller's stays
    assert backend("small") == ("dali", "dali", 3, 4)
    assert backend("large", use_tuning=False)[:2] == ("portable", "stream")
    tuned([])  # a file from before the portable backend was tuned: DALI's threads
    assert backend("large") == ("portable", "stream", 3, 4)
    tuned([{"side_ratio": 2.0, "dali": 900.0, "portable": 1000.0}])  # PIL won at 2x already
    assert backend("small")[0] == "portable"
    tuned([{"side_ratio": 6.0, "dali": 90.0, "portable": 80.0}])  # DALI still won at 6x
    assert backend("large")[0] == "dali"


@pytest.mark.backend
@pytest.mark.dali
def test_training_settles_the_backend_as_image_loader_does(tmp_path) -> None:
    """shardflow train's loaders (trainers/wiring.py) take the portable backend on large
    photos whatever reader the tuning file chose, and report the tuned choices they used."""
    from shardflow.loading.shardlist import resolve_source
    from shardflow.loading.tuning import Tuning
    from shardflow.trainers.wiring import TaskOptions, build_task, split_eval

    shards = side_corpora(tmp_path)
    path = tmp_path / "tuning.json"
    Tuning("cpu", "dali", 3, 4, 100.0, resize_on="dali").save(path)
    for name, want in (("large", "portable"), ("small", "dali")):
        opts = TaskOptions(task="image", data=str(shards[name]), batch_size=2, device="cpu",
                           tuning_file=path)
        split = split_eval(resolve_source(str(shards[name])), None)
        built = build_task(opts, split, 0, 1)
        with built.loader as loader, built.evaluation:
            assert (loader.cfg.backend, loader.backend) == (want, want), name
            assert loader.cfg.reader == ("dali" if want == "dali" else "auto")
        settings = built.loader_settings
        assert "backend" not in settings["tuned"] and settings["tuned"]["threads"] == 3
