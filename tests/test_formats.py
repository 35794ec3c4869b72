"""Image formats as stored: WebP, BMP and TIFF beside JPEG and PNG (shared/BAD_INPUTS.md, "odd
but valid"). Their headers give the size and EXIF orientation PIL gives; shards written by
webdataset's own writer with `.webp`, `.bmp`, `.tiff`, `.JPG` and `.jpeg` members are read in
full by both backends, with the pixels of the same images stored as PNG; make_shards keeps
their bytes, and stores as PNG only what the loaders would not read as it is.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import load_manifest, read_wds, run_tool
from PIL import Image, ImageOps

from shardflow import image_loader
from shardflow.errors import DataError
from shardflow.image.portable import _as_stored
from shardflow.samples import checks, headers

# A dependency, but absent where nothing installs (the lent GPU machine's own Python):
# this file then skips instead of stopping `pytest -m gpu` at collection.
wds = pytest.importorskip("webdataset")

ORIENTATION = 0x0112


def photo(seed: int, width: int = 72, height: int = 56, mode: str = "RGB") -> Image.Image:
    """A smooth gradient with noise: photo-like enough for lossy codecs, in `mode`."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    planes = [(x * 3 + seed * 40) % 256, (y * 4) % 256, ((x + y) * 2) % 256]
    arr = np.clip(np.stack(planes, -1) + rng.normal(0, 12, (height, width, 3)), 0, 255)
    return Image.fromarray(arr.astype(np.uint8)).convert(mode)


def encode(img: Image.Image, fmt: str, orientation: int = 1, **options: Any) -> bytes:
    """`img` saved as `fmt`, with an EXIF orientation (TIFF: the tag in its own IFD)."""
    if orientation != 1 and fmt == "TIFF":
        options["tiffinfo"] = {ORIENTATION: orientation}
    elif orientation != 1:
        exif = Image.Exif()
        exif[ORIENTATION] = orientation
        options["exif"] = exif
    out = io.BytesIO()
    img.save(out, format=fmt, **options)
    return out.getvalue()


def top_down_bmp(img: Image.Image) -> bytes:
    """A 24-bit BMP stored top-down (a negative height), which PIL reads but never writes."""
    rgb = np.asarray(img.convert("RGB"))
    h, w, _ = rgb.shape
    stride = (w * 3 + 3) // 4 * 4
    rows = b"".join(rgb[r, :, ::-1].tobytes().ljust(stride, b"\0") for r in range(h))
    info = struct.pack("<IiiHHIIiiII", 40, w, -h, 1, 24, 0, len(rows), 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + 40 + len(rows), 0, 0, 54) + info + rows


# name -> (member extension, bytes): each a still image the loaders read as it is
def foreign_members() -> dict[str, tuple[str, bytes]]:
    return {
        "lossy": ("webp", encode(photo(1), "WEBP", quality=85)),
        "lossless": ("webp", encode(photo(2), "WEBP", lossless=True)),
        "alpha": ("webp", encode(photo(3, mode="RGBA"), "WEBP", quality=90)),
        "webp-turned": ("webp", encode(photo(4, 60, 44), "WEBP", 6, quality=90)),
        "bitmap": ("bmp", encode(photo(5), "BMP")),
        "palette": ("bmp", encode(photo(6, mode="P"), "BMP")),
        "top-down": ("bmp", top_down_bmp(photo(7))),
        "tiff": ("tiff", encode(photo(8), "TIFF")),
        "tiff-lzw": ("tif", encode(photo(9, mode="L"), "TIFF", compression="tiff_lzw")),
        "tiff-turned": ("tiff", encode(photo(10, 60, 44), "TIFF", 8)),
        "camera": ("JPG", encode(photo(11), "JPEG", quality=90)),
        "long-ext": ("jpeg", encode(photo(12), "JPEG", 3, quality=90)),
    }


def pil_orientation(data: bytes) -> int:
    with Image.open(io.BytesIO(data)) as img:
        return int(img.getexif().get(ORIENTATION, 1))


# -- headers -----------------------------------------------------------------------------------

def test_each_formats_header_gives_pils_size_and_orientation():
    """The upright size is exif_transpose's, the orientation PIL's tag (TIFF: its own IFD's,
    which PIL's TIFF plugin applies as it loads)."""
    for name, (_, data) in foreign_members().items():
        with Image.open(io.BytesIO(data)) as img:
            tag = int(img.getexif().get(ORIENTATION, 1))
            upright = ImageOps.exif_transpose(img).size
        header = headers.read_header(data)
        assert header.upright_size() == upright, name
        assert header.orientation == tag, name
    assert headers.read_header(foreign_members()["webp-turned"][1]).orientation == 6
    assert headers.read_header(foreign_members()["tiff-turned"][1]).orientation == 8
    core = encode(photo(0, 9, 7), "BMP")  # the OS/2 core header: 16-bit sides
    core = core[:14] + struct.pack("<IHHHH", 12, 9, 7, 1, 24) + core[54:]
    assert headers.header_size(core) == (9, 7)


def test_broken_and_animated_headers_are_named():
    members = foreign_members()
    for name in ("lossy", "lossless", "bitmap", "tiff"):
        with pytest.raises(DataError, match="header|not a JPEG") as err:
            headers.read_header(members[name][1][:14])
        assert err.value.reason == "bad-image"
    frames = [photo(i) for i in range(3)]
    animated = io.BytesIO()
    frames[0].save(animated, format="WEBP", save_all=True, append_images=frames[1:])
    with pytest.raises(DataError, match="animated WebP"):
        headers.read_header(animated.getvalue())
    with pytest.raises(DataError, match="JPEG, PNG, WebP, BMP or TIFF"):
        headers.read_header(b"GIF89a" + bytes(20))


# -- foreign shards, both backends ------------------------------------------------------------

def write_shard(path: Path, members: dict[str, tuple[str, bytes]]) -> Path:
    """webdataset's own TarWriter, one sample per image, labels in .cls."""
    with wds.TarWriter(str(path)) as sink:
        for i, (key, (ext, data)) in enumerate(members.items()):
            sink.write({"__key__": key, ext: data, "cls": str(i % 3).encode()})
    return path


def png_twin(data: bytes) -> bytes:
    """The image as a PNG of its stored pixels with its orientation tag: the loaders then
    crop, resize and turn both alike. (PIL's TIFF plugin loads a TIFF upright: its turn is
    undone. checks.reencode_png stores the upright pixels instead, where a resize of the
    turned window rounds a level apart from a turn of the resized one.)"""
    orientation = headers.read_header(data).orientation
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        if img.format == "TIFF":
            img = _as_stored(img, orientation)
        out = io.BytesIO()
        exif = Image.Exif()
        if orientation != 1:
            exif[ORIENTATION] = orientation
        img.save(out, format="PNG", **({"exif": exif} if orientation != 1 else {}))
        return out.getvalue()


@pytest.fixture(scope="module")
def twin_shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The foreign formats, and the same images as PNG under the same keys."""
    root = tmp_path_factory.mktemp("formats")
    members = foreign_members()
    as_png = {key: ("png", png_twin(data)) for key, (_, data) in members.items()}
    return write_shard(root / "foreign.tar", members), write_shard(root / "png.tar", as_png)


def batches_by_key(source: Path, backend: str, train: bool) -> dict[str, torch.Tensor]:
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    with image_loader(str(source), batch_size=4, size=32, device="cpu", seed=5, threads=1,
                      train=train, reader="stream", backend=backend, use_tuning=False,
                      on_error="raise", shuffle_buffer=1) as loader:
        got = {k: b.image[i] for b in loader for i, k in enumerate(b.keys)}
        assert loader.skipped == []
    return got


@pytest.mark.parametrize("backend", [pytest.param("dali", marks=pytest.mark.dali), "portable"])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.backend
def test_foreign_formats_read_in_full_with_the_pixels_of_their_png_twins(twin_shards, backend,
                                                                         train):
    """Every sample is read (WebP lossy, lossless and with alpha; BMP 24-bit, palette and
    top-down; TIFF raw and LZW; .JPG and .jpeg), each random-resized window or centre crop
    decoded from the format itself gives the batch its PNG twin gives, bit for bit, and
    the WebP and TIFF EXIF orientations turn them as PIL turns them."""
    foreign, png = twin_shards
    got, want = batches_by_key(foreign, backend, train), batches_by_key(png, backend, train)
    assert sorted(got) == sorted(foreign_members()) == sorted(want)
    for key in got:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.dali
def test_both_backends_agree_on_the_foreign_formats(twin_shards):
    foreign, _ = twin_shards
    dali, portable = (batches_by_key(foreign, b, False) for b in ("dali", "portable"))
    for key in dali:  # the same decoders' pixels, the same resize
        assert torch.equal(dali[key], portable[key]), key


# A lossless WebP whose EXIF chunk follows its odd-length image chunk, which DALI 2.x's WebP
# parser refuses ("Unexpected end of stream"): make_shards stores it as PNG, the same pixels,
# its orientation kept.
LOSSLESS_TURNED = encode(photo(21, 60, 44), "WEBP", 6, lossless=True)


# -- conversion -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make_shards imagefolder over the foreign formats, an animated WebP (turned by its
    EXIF) and a turned CMYK TIFF: the shards folder."""
    tmp_path = tmp_path_factory.mktemp("converted")
    src = tmp_path / "src"
    for i, (name, (ext, data)) in enumerate(foreign_members().items()):
        folder = src / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.{ext}").write_bytes(data)
    frames = [photo(i) for i in range(2)]
    animated = io.BytesIO()
    turned = Image.Exif()
    turned[ORIENTATION] = 6
    frames[0].save(animated, format="WEBP", save_all=True, append_images=frames[1:],
                   exif=turned)
    (src / "class0" / "animated.webp").write_bytes(animated.getvalue())
    (src / "class1" / "cmyk.tiff").write_bytes(encode(photo(20, mode="CMYK"), "TIFF", 6))
    (src / "class0" / "lossless-turned.webp").write_bytes(LOSSLESS_TURNED)
    out = tmp_path / "out"
    run_tool("make_shards", "imagefolder", src, out, check=True)
    return out


def test_make_shards_keeps_webp_bmp_and_tiff_bytes_and_converts_only_what_loaders_refuse(
        converted):
    out, kept = converted, {name: data for name, (_, data) in foreign_members().items()}
    samples = {s["__key__"].split("_", 1)[1]: s for s in read_wds(out)}  # class0_lossy
    assert len(samples) == len(kept) + 3
    stored = {".JPG": "jpg", ".tif": "tiff"}
    for name, data in kept.items():
        ext = foreign_members()[name][0]
        member = stored.get("." + ext, ext.lower() if ext != "jpeg" else "jpg")
        assert samples[name][member] == data, name  # byte for byte
    assert "png" in samples["animated"] and "png" in samples["cmyk"]
    # the orientation survives the move to PNG: the WebP's frame as stored, with its tag; the
    # TIFF upright (PIL's TIFF plugin turns it as it loads), without one
    assert pil_orientation(samples["animated"]["png"]) == 6
    with Image.open(io.BytesIO(samples["cmyk"]["png"])) as cmyk:
        assert cmyk.size == (56, 72) and pil_orientation(samples["cmyk"]["png"]) == 1
    turned = samples["lossless-turned"]["png"]  # exactly the WebP's pixels, still turned
    assert pil_orientation(turned) == 6 and np.array_equal(
        np.asarray(Image.open(io.BytesIO(turned))), np.asarray(Image.open(
            io.BytesIO(LOSSLESS_TURNED)).convert("RGB")))
    manifest = load_manifest(out)
    assert manifest["reencoded"] == {"webp-to-png": 2, "tiff-to-png": 1}
    run_tool("verify_shards", out, check=True)


@pytest.mark.parametrize("reader, backend", [
    pytest.param("dali", "dali", marks=pytest.mark.dali), ("stream", "portable")])
@pytest.mark.backend
def test_converted_formats_load_in_full(converted, reader, backend):
    """The converted shards (indexed: DALI's reader takes the .webp, .bmp and .tiff members
    as it takes .jpg) give every sample, in training and in evaluation."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    for train in (True, False):
        with image_loader(str(converted), batch_size=4, size=32, device="cpu", seed=1,
                          threads=1, train=train, reader=reader, backend=backend,
                          use_tuning=False, on_error="raise") as loader:
            keys = [k for b in loader for k in b.keys]
        assert len(keys) == len(set(keys)) == len(foreign_members()) + 3


def test_the_rule_says_why_a_tiff_or_webp_becomes_png():
    frames = [photo(i) for i in range(2)]
    animated = io.BytesIO()
    frames[0].save(animated, format="WEBP", save_all=True, append_images=frames[1:])
    assert "2 frames" in checks.loader_problem(animated.getvalue(), "WEBP")
    cmyk = encode(photo(1, mode="CMYK"), "TIFF")
    assert "mode CMYK" in checks.loader_problem(cmyk, "TIFF")
    assert [(kind, length % 2) for kind, _, length in headers.webp_chunks(LOSSLESS_TURNED)] \
        == [(b"VP8X", 0), (b"VP8L", 1), (b"EXIF", 0)]
    assert "EXIF chunk follows a chunk of odd length" in checks.loader_problem(LOSSLESS_TURNED,
                                                                              "WEBP")
    for name, (_, data) in foreign_members().items():
        with Image.open(io.BytesIO(data)) as img:
            fmt = str(img.format)
        assert checks.loader_problem(data, fmt) is None, name


@pytest.mark.dali
def test_the_webp_rule_flags_every_file_dalis_parser_refuses():
    """The rule against DALI itself, on WebPs whose chunks have either parity: lossy and
    lossless, with EXIF behind an ICC profile of odd or even length, with XMP. Every file
    DALI refuses is flagged (and so stored as PNG); every file left unflagged DALI reads."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def, types

    exif = Image.Exif()
    exif[ORIENTATION] = 6
    files = []
    for seed in range(8):
        for lossless in (True, False):
            for meta in ({"exif": exif}, {"icc_profile": bytes(99), "exif": exif},
                         {"icc_profile": bytes(100), "exif": exif}, {"xmp": b"<x/>"}):
                files.append(encode(photo(seed, 30 + seed, 20 + seed), "WEBP",
                                    lossless=lossless, quality=80, **meta))

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def decode():
        data = fn.external_source(name="data", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(data, device="cpu", output_type=types.RGB)

    refused = flagged = 0
    for data in files:
        pipe = decode()
        pipe.build()
        pipe.feed_input("data", [np.frombuffer(data, np.uint8)])
        try:
            pipe.run()
            dali_reads = True
        except RuntimeError:
            dali_reads = False
        flag = checks.loader_problem(data, "WEBP") is not None
        assert flag or dali_reads, [(k, n) for k, _, n in headers.webp_chunks(data)]
        refused += not dali_reads
        flagged += flag
    assert refused >= 8 and flagged <= refused + 2  # both kinds met; few flagged in vain


# -- 16-bit grey TIFF --------------------------------------------------------------------------

# A ramp over the whole 16-bit range (0..65520), and the levels the loaders give of it (the
# high byte); TIFFs of it in PIL's three grey modes above 8 bits.
RAMP16 = np.arange(64 * 64, dtype=np.int64).reshape(64, 64) * 16
GRAY16_TIFFS = {"big-endian": ">u2", "little-endian": "<u2", "32-bit": "<i4"}


def test_16_bit_grey_tiffs_are_stored_as_16_bit_png_of_the_same_values():
    """A 16-bit TIFF in either byte order (PIL's I;16B and I;16) or a 32-bit one (I), which
    the loaders do not read as TIFF, becomes a 16-bit PNG of exactly its values: not RGB
    clipped at 255 (almost all white)."""
    for name, dtype in GRAY16_TIFFS.items():
        data = encode(Image.fromarray(RAMP16.astype(dtype)), "TIFF")
        stored = checks.prepare_image(data, checks.CheckLimits())
        assert (stored.ext, stored.repairs) == ("png", ("tiff-to-png",)), name
        with Image.open(io.BytesIO(stored.data)) as img:
            assert img.mode == "I;16", name
            assert np.array_equal(np.asarray(img), RAMP16), name


@pytest.mark.parametrize("backend", [pytest.param("dali", marks=pytest.mark.dali), "portable"])
@pytest.mark.backend
def test_16_bit_grey_tiffs_load_as_their_high_byte(tmp_path, backend):
    """Converted, each loads as the ramp's high byte in every channel (DALI rounds where the
    portable backend truncates: within 1)."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for name, dtype in GRAY16_TIFFS.items():
        (src / f"{name}.tif").write_bytes(encode(Image.fromarray(RAMP16.astype(dtype)), "TIFF"))
    run_tool("make_shards", "imagefolder", tmp_path / "src", tmp_path / "out", check=True)
    with image_loader(str(tmp_path / "out"), batch_size=1, size=64, device="cpu", threads=1,
                      train=False, crop_fraction=1.0, reader="stream", backend=backend,
                      use_tuning=False) as loader:
        got = {b.keys[0]: b.image[0].numpy().astype(int) for b in loader}
    assert sorted(got) == sorted(f"c_{name}" for name in GRAY16_TIFFS)
    for key, image in got.items():
        assert np.abs(image - (RAMP16 >> 8)).max() <= 1, key


def dali_decoded(data: bytes) -> np.ndarray | None:
    """DALI's CPU decode of one file (HWC RGB), or None where DALI refuses it."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def decode():
        data = fn.external_source(name="data", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(data, device="cpu", output_type=types.RGB)

    pipe = decode()
    pipe.build()
    pipe.feed_input("data", [np.frombuffer(data, np.uint8)])
    try:
        (out,) = pipe.run()
    except RuntimeError:
        return None
    return np.array(out.as_array()[0])


# -- animated PNG ------------------------------------------------------------------------------

def apng(default_is_frame: bool) -> bytes:
    """A PNG of three distinct pictures (photos 30, 31, 32), its default image (IDAT) photo
    30: the first frame of the animation (the usual kind), or, with `default_is_frame` False,
    a picture apart from an animation of photos 31 and 32 (APNG writers' "default image")."""
    first, *rest = (photo(30 + i) for i in range(3))
    out = io.BytesIO()
    first.save(out, format="PNG", save_all=True, append_images=rest,
               default_image=not default_is_frame)
    return out.getvalue()


def test_an_apng_whose_default_image_is_no_frame_is_stored_as_that_image(tmp_path):
    """An APNG whose default image is its first frame is kept byte for byte; one whose default
    image is not a frame (DALI would decode another picture) is stored as a still PNG of the
    default image, counted; verify_shards names the latter in shards made elsewhere."""
    assert checks.loader_problem(apng(True), "PNG") is None
    assert "animated PNG of 2 frames whose default image is not one of them" in \
        checks.loader_problem(apng(False), "PNG")  # photos 31 and 32; 30 is the default
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    (src / "first.png").write_bytes(apng(True))
    (src / "apart.png").write_bytes(apng(False))
    out = tmp_path / "out"
    run_tool("make_shards", "imagefolder", tmp_path / "src", out, check=True)
    samples = {s["__key__"].split("_", 1)[1]: s for s in read_wds(out)}
    assert samples["first"]["png"] == apng(True)
    with Image.open(io.BytesIO(samples["apart"]["png"])) as img:
        assert getattr(img, "n_frames", 1) == 1 and "default_image" not in img.info
        assert np.array_equal(np.asarray(img.convert("RGB")), np.asarray(photo(30)))
    assert load_manifest(out)["reencoded"] == {"apng-to-png": 1}
    run_tool("verify_shards", out, check=True)
    hand = tmp_path / "hand"
    hand.mkdir()
    write_shard(hand / "hand-000000.tar", {"apart": ("png", apng(False))})
    proc = run_tool("verify_shards", hand / "hand-000000.tar", "--jobs", 1)
    assert proc.returncode == 1 and "unsupported-image-format" in proc.stdout
    assert "animated PNG" in proc.stdout


@pytest.mark.dali
def test_dali_decodes_an_apngs_first_frame_and_the_rule_flags_where_that_is_not_pils(tmp_path):
    """What the rule rests on, against DALI itself: DALI decodes an APNG's first frame, PIL
    its default image. The same picture when the default image is the first frame (kept);
    another when it is not (flagged), whose repair both then decode alike."""
    pytest.importorskip("nvidia.dali")
    default, frame = np.asarray(photo(30)), np.asarray(photo(31))
    assert np.array_equal(dali_decoded(apng(True)), default)
    assert np.array_equal(dali_decoded(apng(False)), frame)
    repaired = checks.prepare_image(apng(False), checks.CheckLimits())
    assert repaired.repairs == ("apng-to-png",)
    assert np.array_equal(dali_decoded(repaired.data), default)
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for name, data in (("first", apng(True)), ("apart", apng(False))):
        (src / f"{name}.png").write_bytes(data)
    run_tool("make_shards", "imagefolder", tmp_path / "src", tmp_path / "out", check=True)
    dali, portable = (batches_by_key(tmp_path / "out", b, False) for b in ("dali", "portable"))
    assert sorted(dali) == sorted(portable) == ["c_apart", "c_first"]
    for key in dali:
        assert torch.equal(dali[key], portable[key]), key


def test_an_orientation_only_in_xmp_is_not_made_exif_when_stored_as_png():
    """An animated WebP (stored as PNG) whose orientation is only in XMP: the loaders read
    the orientation from EXIF only (headers.py), so the PNG gets no EXIF tag from it, which
    would turn an image no loader turned (Pillow's getexif() takes XMP's)."""
    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/'
           b'02/22-rdf-syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/"'
           b' tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    frames = [photo(i) for i in range(2)]
    animated = io.BytesIO()
    frames[0].save(animated, format="WEBP", save_all=True, append_images=frames[1:], xmp=xmp)
    assert pil_orientation(animated.getvalue()) == 6
    stored = checks.prepare_image(animated.getvalue(), checks.CheckLimits())
    assert stored.repairs == ("webp-to-png",)
    assert headers.read_header(stored.data) == headers.ImageHeader(72, 56, 1)


def test_a_floating_point_tiff_is_refused_not_clipped_to_rgb():
    """Mode F (a depth map, a scientific image): its values have no fixed range, and RGB
    would clip them at 255; refused with what to do, and named by the check verify runs."""
    values = np.linspace(0.0, 1000.0, 600, dtype=np.float32).reshape(20, 30)
    out = io.BytesIO()
    Image.fromarray(values, "F").save(out, "TIFF")
    with pytest.raises(DataError, match=r"floating-point.*\[unsupported-image-format\]"):
        checks.prepare_image(out.getvalue(), checks.CheckLimits())
    assert "mode F" in checks.loader_problem(out.getvalue(), "TIFF")
