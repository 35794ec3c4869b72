"""pipeline/image/restarts.py: a JPEG with restart markers is decoded from the last marker
above the window. Its rows are the very rows of a decode from the top; the window resized
from them is within one level of it (PIL's resize of a box moved up by whole rows rounds a
few values the other way). Where the markers are out of order, or there are none, the file
is decoded from the top as before."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from shardflow.image import restarts
from shardflow.image.augment import CropParams
from shardflow.image.portable import _from_the_top, decode_window
from tests.test_rows import jpeg, windows

# Camera-like files: libjpeg writes a restart marker every `restart_marker_rows` MCU rows or
# every `restart_marker_blocks` MCUs (an interval that need not end at a row's edge).
KINDS = {
    "4:2:0, every row": lambda: jpeg(900, 1200, quality=90, restart_marker_rows=1),
    "4:2:2, every 3 MCUs": lambda: jpeg(700, 1000, quality=85, subsampling=1,
                                        restart_marker_blocks=3),
    "4:4:4, every 2 rows": lambda: jpeg(600, 800, quality=90, subsampling=0,
                                        restart_marker_rows=2),
    "gray, every 5 MCUs": lambda: jpeg(640, 480, mode="L", restart_marker_blocks=5),
    "cmyk, every row": lambda: jpeg(500, 640, mode="CMYK", restart_marker_rows=1),
    "odd size, every row": lambda: jpeg(333, 517, quality=75, restart_marker_rows=1),
}


def decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_window_from_a_restart_marker_is_the_window_from_the_top(kind: str) -> None:
    data = KINDS[kind]()
    width, height = Image.open(io.BytesIO(data)).size
    cuts, apart, values = 0, 0, 0
    for window in windows(width, height, 40, seed=len(kind)):
        for size in (32, 224):  # drafted (1/2..1/8) and full-scale crops both
            below = decode_window(data, window, size, cut=True).astype(int)
            whole = decode_window(data, window, size, cut=False).astype(int)
            assert below.shape == whole.shape and np.abs(below - whole).max() <= 1, window
            apart, values = apart + np.count_nonzero(below != whole), values + below.size
        cuts += restarts.cut_above(data, window.y) is not None
    assert cuts >= 2  # the cut was taken, not passed over
    assert apart <= 0.02 * values


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_cut_holds_the_rows_below_its_marker(kind: str) -> None:
    data = KINDS[kind]()
    full = decoded(data)
    found = restarts.layout(data)
    assert found is not None
    for first in range(0, full.shape[0], 50):
        cut = restarts.cut_above(data, first)
        if cut is None:
            continue
        assert first - cut.top >= found.mcu_height  # a whole MCU row of margin
        part = decoded(cut.data)
        assert part.shape == (full.shape[0] - cut.top, *full.shape[1:])
        # Every row from the margin down is the full decode's; the first row may not be
        # (the chroma upsampling reads a row above it, which the cut does not hold).
        assert np.array_equal(part[found.mcu_height:], full[cut.top + found.mcu_height:])


def test_the_latest_marker_that_starts_a_row_after_an_rst7_is_chosen() -> None:
    data = KINDS["4:2:0, every row"]()  # 1200 / 16: 75 MCUs a row, one interval a row
    found = restarts.layout(data)
    assert found == restarts.Layout(found.height_at, 900, 16, 75, 75, found.scan_data)
    assert restarts.cut_above(data, 16 * 9).top == 16 * 8  # interval 8 follows an RST7
    assert restarts.cut_above(data, 16 * 8) is None  # none a whole row above it
    assert restarts.cut_above(data, 16 * 30).top == 16 * 24
    every_3 = restarts.layout(KINDS["4:2:2, every 3 MCUs"]())  # 1000 / 16: 63 MCUs a row
    assert (every_3.mcu_height, every_3.mcus_per_row, every_3.interval) == (8, 63, 3)
    # rows where 63 * row / 3 = 21 * row intervals is a multiple of 8: rows 8, 16, 24...
    assert restarts.start_row(every_3, 23) == 16


def no_markers() -> bytes:
    return jpeg(600, 800, quality=90)


def progressive() -> bytes:
    return jpeg(600, 800, quality=90, progressive=True)


def renumbered() -> bytes:
    """An RST3 marker above every cut made an RST4: the numbering is out of order there."""
    data = bytearray(KINDS["4:2:0, every row"]())
    found = restarts.layout(bytes(data))
    third = restarts.restart_marker(bytes(data), found, 3)
    data[third + 1] += 1
    return bytes(data)


def missing() -> bytes:
    """One restart marker above every cut dropped: the intervals around it run together."""
    data = KINDS["4:2:0, every row"]()
    third = restarts.restart_marker(data, restarts.layout(data), 3)
    return data[:third] + data[third + 2:]


@pytest.mark.parametrize("make", [no_markers, progressive, renumbered, missing])
def test_a_file_whose_markers_cannot_be_trusted_is_decoded_from_the_top(make) -> None:
    data = make()
    assert restarts.cut_above(data, 500) is None
    window = CropParams(100, 450, 500, 140, False)
    try:
        whole = decode_window(data, window, 224, cut=False)
    except OSError:  # libjpeg gave up on the damage: so does the cut
        with pytest.raises(OSError):
            decode_window(data, window, 224, cut=True)
    else:
        assert np.array_equal(decode_window(data, window, 224, cut=True), whole)


@pytest.mark.parametrize("keep, top", [(1 / 2, 300), (0.98, 800)])
def test_a_file_cut_short_is_refused_as_before(keep: float, top: int) -> None:
    data = KINDS["4:2:0, every row"]()
    short = data[: int(len(data) * keep)]
    window = CropParams(0, top, 300, 100, False)  # its rows all there, a marker above it
    assert restarts.cut_above(short, window.y) is not None  # the markers are there
    with pytest.raises(OSError, match="truncated"):
        decode_window(short, window, 224, cut=True)


def test_a_photo_loader_over_restart_markers_gives_the_batches_of_a_full_decode(
        tmp_path, monkeypatch) -> None:
    """Phone photos, stored sideways with an EXIF turn, through the portable loader's whole
    path: windows, turn, flip, resize."""
    from shardflow import image_loader
    from shardflow.convert import ConvertConfig, convert
    from shardflow.image.portable import PortableImageStage

    folder = tmp_path / "photos" / "class_0"
    folder.mkdir(parents=True)
    for i in range(6):
        exif = Image.Exif()
        exif[0x0112] = (1, 6, 8, 3, 1, 6)[i]
        (folder / f"{i}.jpg").write_bytes(jpeg(1000, 1400, seed=i, quality=90,
                                               restart_marker_rows=1, exif=exif))
    convert(ConvertConfig(kind="imagefolder", src=str(tmp_path / "photos"),
                          out=str(tmp_path / "shards"), workers=1, max_count=3))

    def batches(cut: bool) -> list[tuple[list[str], np.ndarray]]:
        monkeypatch.setattr(PortableImageStage, "cut", cut)
        with image_loader(tmp_path / "shards", batch_size=3, backend="portable", size=96,
                          seed=5) as loader:
            return [(list(b.keys), b.image.numpy()) for b in loader]

    below, whole = batches(True), batches(False)
    assert [k for k, _ in below] == [k for k, _ in whole] and len(below) == 2
    for (_, a), (_, b) in zip(below, whole, strict=True):
        assert np.array_equal(a, b)


def test_the_camera_corpus_has_a_marker_every_mcu_row_and_is_cut_at_them() -> None:
    """bench_loader --photos camera: the large photos as cameras' encoders write them."""
    from shardflow.builtin.photos import render_large_photo

    plain = render_large_photo(np.random.default_rng(3), 0.3)
    camera = render_large_photo(np.random.default_rng(3), 0.3, restart_rows=1)
    assert restarts.layout(plain) is None
    found = restarts.layout(camera)
    assert found is not None and found.interval == found.mcus_per_row
    assert restarts.cut_above(camera, found.height // 2) is not None
    window = CropParams(500, found.height // 2, 1200, 1000, False)
    assert np.abs(decode_window(camera, window, 224).astype(int) -
                  decode_window(camera, window, 224, cut=False)).max() <= 1


@pytest.mark.parametrize("marker", [0xE0, 0xD9, 0xFE, 0xD8, 0xC4, 0xDA])
def test_another_marker_above_the_cut_sends_the_file_to_the_decode_from_the_top(marker) -> None:
    """Damage that reads as a marker in the scan: libjpeg, meeting it where a restart should
    be, leaves the rest of the scan empty (and some markers fail the decompression's end,
    which the row cut of rows.py never reaches); the cut, which would never meet it, is not
    made, so the file is decoded from the top exactly as before."""
    data = bytearray(KINDS["4:2:0, every row"]())
    found = restarts.layout(bytes(data))
    at = restarts.restart_marker(bytes(data), found, 4) - 40  # inside interval 4
    data[at: at + 2] = bytes([0xFF, marker])
    data = bytes(data)
    assert restarts.cut_above(data, 600) is None
    window = CropParams(100, 600, 500, 200, False)
    for size in (224, 96):
        before = _from_the_top(data, window, size, draft=True, cut=True)  # rows.py alone
        assert np.array_equal(decode_window(data, window, size, cut=True), before)


def test_a_file_that_ends_inside_its_scan_header_is_not_cut() -> None:
    data = KINDS["4:2:0, every row"]()
    sos = data.index(b"\xff\xda")
    assert restarts.layout(data[: sos + 6]) is None
    assert restarts.cut_above(data[: sos + 6] + b"\xff\xdd", 300) is None
