"""Real-world images: phone photos with EXIF orientation, and shards without labels
(image-only and caption datasets, `.jpg` + `.txt` + `.json`). Every file is a real one, made
here with PIL and written to shards with the project's tools or with webdataset's writer."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import run_tool
from PIL import Image, ImageOps

from shardflow import image_loader
from shardflow.errors import DataError
from shardflow.image import augment, resize
from shardflow.image.graph import orient_matrix
from shardflow.loading.rng import sample_rng
from shardflow.samples import headers

SIZE = 32
OPTS = {"size": SIZE, "threads": 1, "shuffle_buffer": 16, "use_tuning": False}
H, W = 61, 97  # odd sides: a window mapped to the wrong side of the image is off by one


def _photo() -> np.ndarray:
    """Smooth and asymmetric: red grows to the right, green downwards, a blue block sits
    top-left. Any wrong flip or turn moves a lot of it; JPEG keeps it nearly exact."""
    y, x = np.mgrid[0:H, 0:W]
    blue = ((x < 30) & (y < 20)) * 255
    return np.stack([x * 255 // W, y * 255 // H, blue], -1).astype(np.uint8)


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def _encoded(orientation: int, fmt: str = "JPEG") -> bytes:
    out = io.BytesIO()
    extra = {"quality": 95} if fmt == "JPEG" else {}
    Image.fromarray(_photo()).save(out, fmt, exif=_exif(orientation), **extra)
    return out.getvalue()


def _pil(data: bytes, upright: bool) -> np.ndarray:
    """The reference: PIL's decode, turned by PIL's own exif_transpose when `upright`."""
    img = Image.open(io.BytesIO(data))
    return np.asarray((ImageOps.exif_transpose(img) if upright else img).convert("RGB"))


def _turn(stored: np.ndarray, orientation: int) -> np.ndarray:
    """What PIL's exif_transpose does for `orientation`, on an array (to build wrong answers)."""
    img = Image.fromarray(stored)
    out = img if orientation == 1 else ImageOps.exif_transpose(_tagged(img, orientation))
    return np.asarray(out.convert("RGB"))


def _tagged(img: Image.Image, orientation: int) -> Image.Image:
    out = io.BytesIO()
    img.save(out, "PNG", exif=_exif(orientation))
    return Image.open(io.BytesIO(out.getvalue()))


# -- the header and the window mapping --------------------------------------------------------

@pytest.mark.parametrize("orientation", range(1, 9))
def test_jpeg_and_png_orientation_is_read_as_pil_reads_it(orientation):
    for fmt in ("JPEG", "PNG"):
        data = _encoded(orientation, fmt)
        header = headers.read_header(data)
        assert (header.width, header.height, header.orientation) == (W, H, orientation)
        assert Image.open(io.BytesIO(data)).getexif()[0x0112] == orientation
        assert header.upright_size() == _pil(data, upright=True).shape[1::-1]


def _tiff(order: str, entries: list[tuple[int, int, bytes]]) -> bytes:
    """A TIFF block (EXIF's body) with one IFD of (tag, type, 4-byte value) entries."""
    head = (b"II*\0" if order == "<" else b"MM\0*") + struct.pack(order + "I", 8)
    ifd = struct.pack(order + "H", len(entries))
    for tag, kind, value in entries:
        ifd += struct.pack(order + "HHI", tag, kind, 1) + value
    return head + ifd + b"\0\0\0\0"


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")  # PIL, on the reference's side
def test_odd_and_broken_exif_blocks():
    assert headers.tiff_orientation(_tiff(">", [(0x0112, 3, b"\0\x06\0\0")])) == 6  # Motorola
    assert headers.tiff_orientation(_tiff("<", [(0x010F, 2, b"abc\0"),
                                                (0x0112, 3, b"\x08\0\0\0")])) == 8
    assert headers.tiff_orientation(_tiff("<", [(0x0112, 4, b"\x03\0\0\0")])) == 3  # LONG
    for broken in (_tiff("<", [(0x0112, 3, b"\x09\0\0\0")]),  # out of range
                   _tiff("<", [(0x0112, 3, b"\0\0\0\0")]),
                   _tiff("<", [(0x0112, 2, b"6\0\0\0")]),  # ASCII
                   _tiff("<", [(0x0112, 3, b"\x06\0\0\0")])[:15],  # cut inside the entry
                   b"II*\0" + struct.pack("<I", 10**6),  # IFD beyond the end
                   b"XX*\0\x08\0\0\0", b""):
        assert headers.tiff_orientation(broken) == 1, broken
    # In a real JPEG: the tag renamed, or the IFD pointing past the block: as stored, as PIL.
    data = _encoded(6)
    at = data.index(b"Exif\0\0") + 6  # the TIFF block (PIL writes it big-endian)
    order = ">" if data[at: at + 2] == b"MM" else "<"
    tag = struct.pack(order + "HH", 0x0112, 3)
    no_tag = data.replace(tag, struct.pack(order + "HH", 0x0001, 3), 1)
    far_ifd = data[:at + 4] + struct.pack(order + "I", 10**6) + data[at + 8:]
    assert tag in data and headers.read_header(data).orientation == 6
    for broken in (no_tag, far_ifd):
        assert headers.read_header(broken) == headers.ImageHeader(W, H, 1)
        assert _pil(broken, upright=True).shape[:2] == (H, W)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_window_mapped_to_the_stored_frame_then_turned_is_the_upright_window(orientation):
    data = _encoded(orientation)
    stored, upright = _pil(data, upright=False), _pil(data, upright=True)
    rng = np.random.default_rng(orientation)
    up_h, up_w = upright.shape[:2]
    for _ in range(20):
        w, h = int(rng.integers(1, up_w + 1)), int(rng.integers(1, up_h + 1))
        x, y = int(rng.integers(0, up_w - w + 1)), int(rng.integers(0, up_h - h + 1))
        flip = bool(rng.integers(2))
        s = augment.to_stored(augment.CropParams(x, y, w, h, flip), orientation, W, H)
        got = stored[s.y: s.y + s.height, s.x: s.x + s.width]
        got = got.transpose(1, 0, 2) if s.transpose else got
        got = got[::-1] if s.vflip else got
        got = got[:, ::-1] if s.flip else got
        want = upright[y: y + h, x: x + w]
        np.testing.assert_array_equal(got, want[:, ::-1] if flip else want)


def test_the_graphs_orientation_warp_moves_pixels_exactly():
    from nvidia.dali import fn, pipeline_def, types

    square = np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    cases = [(t, v) for t in (False, True) for v in (False, True)]

    @pipeline_def(batch_size=4, num_threads=1, device_id=None, prefetch_queue_depth=1)
    def pipe():  # type: ignore[no-untyped-def]
        images = fn.external_source(name="x", dtype=types.UINT8, ndim=3, layout="HWC")
        turn = fn.external_source(name="m", dtype=types.FLOAT, ndim=2)
        return fn.warp_affine(images, matrix=turn, size=[SIZE, SIZE],
                              interp_type=types.INTERP_NN)

    p = pipe()
    p.build()
    p.feed_input("x", [square] * 4)
    p.feed_input("m", [np.array(orient_matrix(t, v, SIZE), np.float32) for t, v in cases])
    (out,) = p.run()
    for i, (t, v) in enumerate(cases):
        want = square.transpose(1, 0, 2) if t else square
        np.testing.assert_array_equal(np.asarray(out[i]), want[::-1] if v else want)


# -- photos through the loader ---------------------------------------------------------------

@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Each orientation 1-8 as a JPEG, 6 also as a PNG with an eXIf chunk, and one JPEG
    without EXIF, converted by make_shards (image bytes are kept as they are)."""
    root = tmp_path_factory.mktemp("photos")
    folder = root / "src" / "phone"
    folder.mkdir(parents=True)
    files = {f"o{o}": _encoded(o) for o in range(1, 9)}
    files["o6png"] = _encoded(6, "PNG")
    plain = io.BytesIO()
    Image.fromarray(_photo()).save(plain, "JPEG", quality=95)
    files["noexif"] = plain.getvalue()
    for name, data in files.items():
        (folder / (name + (".png" if name.endswith("png") else ".jpg"))).write_bytes(data)
    run_tool("make_shards", "imagefolder", root / "src", root / "out", check=True)
    return SimpleNamespace(out=root / "out", files={f"phone_{k}": v for k, v in files.items()})


def _orientation_of(key: str) -> int:
    return int(key.split("_o")[1][0]) if "_o" in key else 1


def _loaded(out: Path, **options: object) -> dict[str, torch.Tensor]:
    with image_loader(out, batch_size=4, **{**OPTS, **options}) as loader:  # type: ignore[arg-type]
        return {k: img.float() for b in loader for k, img in zip(b.keys, b.image, strict=True)}


def _expected(pixels: np.ndarray, key: str, train: bool) -> torch.Tensor:
    """The loader's output computed from upright pixels: the window drawn as the loader draws
    it (the same function, key and epoch), cut out and resized by torch."""
    height, width = pixels.shape[:2]
    if train:
        w = augment.random_resized_crop(sample_rng(0, 0, key), width, height, (0.08, 1.0),
                                        (3 / 4, 4 / 3))
    else:
        w = augment.center_crop(width, height, 0.875)
    window = np.array(pixels[w.y: w.y + w.height, w.x: w.x + w.width])  # writable, for torch
    return resize.batch([window], [w.flip], SIZE, True, None)[0].float()


def _check_upright(got: dict[str, torch.Tensor], files: dict[str, bytes], train: bool,
                   tolerance: float) -> None:
    """Each image is the upright reference within resampling noise, and clearly farther from
    every other way of turning it (so a wrong or missing turn cannot pass)."""
    assert got.keys() == files.keys()
    for key, image in got.items():
        stored = _pil(files[key], upright=False)
        right = _expected(_pil(files[key], upright=True), key, train)
        same = (image - right).abs().mean().item()
        wrong = [(image - _expected(_turn(stored, o), key, train)).abs().mean().item()
                 for o in range(1, 9) if o != _orientation_of(key)]
        assert same < tolerance < 3 * tolerance < min(wrong), (key, same, min(wrong))


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("resize_on", ["torch", "dali"])
def test_photos_come_out_upright_on_both_cpu_paths(photos, train, resize_on):
    got = _loaded(photos.out, train=train, device="cpu", resize_on=resize_on)
    _check_upright(got, photos.files, train, tolerance=2.0)


def test_the_torch_and_graph_paths_agree_on_turned_photos(photos):
    torch_out = _loaded(photos.out, train=True, device="cpu", resize_on="torch")
    graph_out = _loaded(photos.out, train=True, device="cpu", resize_on="dali")
    for key, image in torch_out.items():
        assert (image - graph_out[key]).abs().mean().item() < 2.0, key


@pytest.mark.parametrize("resize_on", ["torch", "dali"])
def test_exif_orientation_off_gives_the_stored_frame(photos, resize_on):
    got = _loaded(photos.out, train=False, device="cpu", resize_on=resize_on,
                  exif_orientation=False)
    for key, image in got.items():
        stored = _pil(photos.files[key], upright=False)
        same = (image - _expected(stored, key, False)).abs().mean().item()
        assert same < 2.0, (key, same)
        if _orientation_of(key) != 1:
            upright = _expected(_pil(photos.files[key], upright=True), key, False)
            assert (image - upright).abs().mean().item() > 6.0, key


@pytest.mark.gpu
@pytest.mark.dali  # decode="gpu" is DALI's mixed decode
def test_gpu_graph_turns_photos_upright_too(photos):
    got = _loaded(photos.out, train=True, device="cuda", decode="gpu")
    _check_upright({k: v.cpu() for k, v in got.items()}, photos.files, True, tolerance=3.0)


# -- shards without labels -------------------------------------------------------------------

def _small_jpeg(seed: int) -> bytes:
    out = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


CAPTIONS = {f"cap{i:03d}": (f"a photo of thing {i} ✓", {"id": i, "tags": ["x", str(i)]})
            for i in range(10)}


@pytest.fixture(scope="module")
def captions(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Caption shards as people make them: webdataset's ShardWriter, .jpg + .txt + .json,
    no .cls (read by the streaming reader); and the same re-sharded by make_shards, indexed
    and with a manifest (read by DALI's reader)."""
    import webdataset as wds

    root = tmp_path_factory.mktemp("captions")
    (root / "wds").mkdir()
    with wds.ShardWriter(str(root / "wds" / "cap-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i, (key, (text, meta)) in enumerate(CAPTIONS.items()):
            sink.write({"__key__": key, "jpg": _small_jpeg(i), "txt": text.encode(),
                        "json": json.dumps(meta).encode()})
    run_tool("make_shards", "shards", root / "wds", root / "indexed", "--max-count", 4,
             check=True)
    return SimpleNamespace(wds=sorted(str(p) for p in (root / "wds").glob("*.tar")),
                           indexed=root / "indexed")


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_caption_shards_read_without_labels_with_text_and_json(captions, reader):
    source = captions.indexed if reader == "dali" else captions.wds
    seen = {}
    with image_loader(source, batch_size=4, device="cpu", labels=False,
                      extras=("txt", "json"), **OPTS) as loader:
        assert loader.reader == reader
        for batch in loader:
            assert batch.label is None and batch.image.shape[1:] == (3, SIZE, SIZE)
            assert set(batch.extras) == {"txt", "json"}
            seen.update(zip(batch.keys, zip(batch.extras["txt"], batch.extras["json"],
                                            strict=True), strict=True))
    assert seen == CAPTIONS


def test_labels_asked_of_indexed_unlabelled_shards_fail_at_build(captions):
    with pytest.raises(ValueError, match="no sample of the 3 shards.*labels=False"):
        image_loader(captions.indexed, batch_size=4, device="cpu", **OPTS)


def test_labels_asked_of_streamed_unlabelled_shards_fail_at_the_first_batch(captions):
    with image_loader(captions.wds, batch_size=4, device="cpu", **OPTS) as loader, \
            pytest.raises(DataError, match=r"cap-00000\d\.tar key 'cap\d+'.*no \.cls.*"
                          r"labels=False"):
        next(iter(loader))


def test_an_epoch_in_which_every_sample_was_skipped_is_an_error(captions):
    with image_loader(captions.wds, batch_size=4, device="cpu", on_error="skip",
                      **OPTS) as loader:
        with pytest.raises(DataError, match=r"every sample of epoch 0 was skipped: "
                           r"10 missing-field.*labels=False"):
            list(loader)
        assert loader.skip_counts() == {"missing-field": 10}


def _writer_shard(tmp_path: Path, samples: list[dict[str, object]]) -> Path:
    from shardflow.shards.writer import ShardWriter

    writer = ShardWriter(tmp_path, "train", max_count=100, max_size=10**8)
    for sample in samples:
        writer.write(sample)
    writer.finish()
    return tmp_path / "train-000000.tar"


BAD_EXTRAS = {"badutf8": ({"txt": b"caf\xe9"}, "bad-utf8"),
              "nul": ({"txt": b"a\0b"}, "nul-byte"),
              "badjson": ({"json": b"{'id': 1}"}, "bad-json"),
              "deepjson": ({"json": b"[" * 4000}, "bad-json"),  # deeper than the stack
              "hugejson": ({"json": b'"' + b"x" * 5000 + b'"'}, "extra-too-large"),
              "nojson": ({"json": None}, "missing-field")}


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_bad_extras_are_data_errors_naming_shard_and_key(tmp_path, reader):
    good = {"txt": b"fine", "json": b'{"ok": true}'}
    samples: list[dict[str, object]] = [{"__key__": f"good{i}", "jpg": _small_jpeg(i), **good}
                                        for i in range(4)]
    samples.append({"__key__": "emptytxt", "jpg": _small_jpeg(9), "txt": b"",
                    "json": b"null"})
    for key, (members, _reason) in BAD_EXTRAS.items():
        member = {**good, **members}
        samples.append({"__key__": key, "jpg": _small_jpeg(5),
                        **{k: v for k, v in member.items() if v is not None}})
    shard = _writer_shard(tmp_path, samples)
    opts = {**OPTS, "shuffle_buffer": 0, "max_extra_bytes": 4096}
    with image_loader([str(shard)], batch_size=4, device="cpu", labels=False, train=False,
                      extras=("txt", "json"), reader=reader, **opts) as loader, \
            pytest.raises(DataError) as raised:
        list(loader)
    assert raised.value.source.endswith("train-000000.tar")
    assert raised.value.reason == BAD_EXTRAS[raised.value.key][1]
    with image_loader([str(shard)], batch_size=4, device="cpu", labels=False, train=False,
                      extras=("txt", "json"), reader=reader, on_error="skip",
                      **opts) as loader:
        got = {k: (t, j) for b in loader for k, t, j in zip(b.keys, b.extras["txt"],
                                                             b.extras["json"], strict=True)}
    assert loader.skip_counts() == {"bad-json": 2, "bad-utf8": 1, "extra-too-large": 1,
                                    "missing-field": 1, "nul-byte": 1}
    assert {e["key"]: e["reason"] for e in loader.skipped} == \
        {k: reason for k, (_, reason) in BAD_EXTRAS.items()}
    # A 0-byte member is an empty caption, not a missing one (DALI gives both as empty).
    assert got == {**{f"good{i}": ("fine", {"ok": True}) for i in range(4)},
                   "emptytxt": ("", None)}


def test_labelled_shards_can_be_read_without_labels_and_extras_are_optional(photos):
    with image_loader(photos.out, batch_size=4, device="cpu", labels=False, **OPTS) as loader:
        batches = list(loader)
    assert all(b.label is None and b.extras is None for b in batches)
    assert sum(len(b) for b in batches) == len(photos.files)
    with image_loader(photos.out, batch_size=4, device="cpu", **OPTS) as loader:
        batch = next(iter(loader))
    assert batch.label.dtype == torch.int64 and batch.extras is None


@pytest.mark.parametrize("extras, says", [
    (("jpg",), "read by the loader itself"), (("cls",), "read by the loader itself"),
    (("pkl",), "pickle"), (("txt", "txt"), "named twice"), ("txt", "a tuple"),
    (("",), "a tuple")])
def test_bad_extras_options_name_the_option(photos, extras, says):
    with pytest.raises(ValueError, match=f"extras=.*{says}"):
        image_loader(photos.out, batch_size=4, device="cpu", extras=extras, **OPTS)


def test_classification_refuses_a_batch_without_labels():
    from shardflow.loading.batch import ImageBatch
    from shardflow.trainers.image_task import ImageClassification

    task = ImageClassification(num_classes=3)
    batch = ImageBatch(image=torch.zeros((2, 3, SIZE, SIZE), dtype=torch.uint8), label=None,
                       keys=["a", "b"])
    with pytest.raises(ValueError, match="needs labels.*labels=False"):
        task.forward(batch)
    with pytest.raises(ValueError, match="needs labels"):
        task.evaluate(batch)
