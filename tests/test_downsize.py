"""make_shards --max-side N --jpeg-quality Q: images above N stored turned upright and resized,
as JPEG (PNG with transparency), the rest byte for byte; the manifest records the settings and
the count; the loaders read the result unchanged.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import read_wds, run_tool
from PIL import Image, ImageOps

from shardflow import image_loader

ORIENTATION = 0x0112


def photo(seed: int, width: int, height: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    planes = [(x + seed * 40) % 256, (y // 2) % 256, ((x + y) // 3) % 256]
    arr = np.clip(np.stack(planes, -1) + rng.normal(0, 6, (height, width, 3)), 0, 255)
    return Image.fromarray(arr.astype(np.uint8)).convert(mode)


def saved(img: Image.Image, fmt: str, orientation: int = 1) -> bytes:
    out, options = io.BytesIO(), {}
    if orientation != 1:
        exif = Image.Exif()
        exif[ORIENTATION] = orientation
        options["exif"] = exif
    img.save(out, format=fmt, **({"quality": 92} if fmt == "JPEG" else {}), **options)
    return out.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("downsize") / "src"
    files = {"a/turned.jpg": saved(photo(1, 400, 300), "JPEG", 6),
             "a/small.jpg": saved(photo(2, 100, 80), "JPEG"),
             "b/alpha.png": saved(photo(3, 300, 300, "RGBA"), "PNG"),
             "b/grey.jpg": saved(photo(4, 260, 200, "L"), "JPEG")}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root, files


def convert(src: Path, out: Path, *flags: object) -> dict[str, dict]:
    run_tool("make_shards", "imagefolder", src, out, "--quiet", *flags, check=True)
    return {s["__key__"].split("_", 1)[1]: s for s in read_wds(out)}


@pytest.mark.backend
def test_images_above_max_side_are_resized_upright_and_the_rest_kept(folder, tmp_path):
    src, files = folder
    out = tmp_path / "out"
    got = convert(src, out, "--max-side", 128, "--jpeg-quality", 85)
    with Image.open(io.BytesIO(got["turned"]["jpg"])) as img:
        assert img.size == (96, 128) and ORIENTATION not in img.getexif()  # upright, no tag
        small = np.asarray(img.convert("RGB")).astype(int)
    with Image.open(io.BytesIO(files["a/turned.jpg"])) as img:
        want = np.asarray(ImageOps.exif_transpose(img).resize((96, 128), Image.LANCZOS))
    assert np.abs(small - want).mean() < 3  # the same picture, JPEG at 85 apart
    assert got["small"]["jpg"] == files["a/small.jpg"]  # within N: byte for byte
    with Image.open(io.BytesIO(got["alpha"]["png"])) as img:
        assert img.size == (128, 128) and img.mode == "RGBA"
    with Image.open(io.BytesIO(got["grey"]["jpg"])) as img:
        assert img.size == (128, 98) and img.mode == "L"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["reencoded"] == {"resized": 3}
    assert manifest["args"]["limits"]["downsize"] == {"max_side": 128, "jpeg_quality": 85,
                                                      "reencode_all": False}
    run_tool("verify_shards", out, check=True)
    with image_loader(str(out), batch_size=2, size=32, device="cpu", reader="stream",
                      backend="portable", use_tuning=False, threads=1) as loader:
        assert sorted(k.split("_", 1)[1] for b in loader for k in b.keys) == sorted(got)


def test_reencode_all_and_refusals(folder, tmp_path):
    src, files = folder
    got = convert(src, tmp_path / "all", "--max-side", 128, "--reencode-all")
    assert got["small"]["jpg"] != files["a/small.jpg"]
    with Image.open(io.BytesIO(got["small"]["jpg"])) as img:
        assert img.size == (100, 80)
    manifest = json.loads((tmp_path / "all" / "manifest.json").read_text())
    assert manifest["reencoded"] == {"resized": 3, "reencoded-at-quality": 1}
    proc = run_tool("make_shards", "imagefolder", src, tmp_path / "x", "--reencode-all")
    assert proc.returncode != 0 and "give --max-side N" in proc.stderr


def test_a_16_bit_tiff_resized_keeps_its_levels(tmp_path):
    """A big-endian 16-bit TIFF (I;16B) above N is stored as a 16-bit PNG of the resized
    values, not as a JPEG clipped to white."""
    ramp = (np.arange(192 * 256, dtype=np.int64).reshape(192, 256) * 5).astype(np.uint16)
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    (src / "scan.tif").write_bytes(saved(Image.fromarray(ramp.astype(">u2")), "TIFF"))
    got = convert(tmp_path / "src", tmp_path / "out", "--max-side", 64)
    with Image.open(io.BytesIO(got["scan"]["png"])) as img:
        assert img.size == (64, 48) and img.mode == "I;16"
        small = np.asarray(img).astype(int)
    want = np.asarray(Image.fromarray(ramp).resize((64, 48), Image.LANCZOS)).astype(int)
    assert np.abs((small >> 8) - (want >> 8)).max() <= 1


# An XMP packet whose tiff:Orientation (6) Pillow's exif_transpose applies; the loaders read
# the orientation from EXIF only (pipeline/samples/headers.py).
XMP_TURNED = (b'<?xpacket begin="" id="W5M0MpCehiHzreSzNTczkc9d"?><x:xmpmeta xmlns:x="adobe:ns:'
              b'meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#"><rdf:'
              b'Description rdf:about="" xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:'
              b'Orientation="6"/></rdf:RDF></x:xmpmeta><?xpacket end="w"?>')


def raw_profile_png(img: Image.Image, orientation: int) -> bytes:
    """A PNG whose orientation is only in a "Raw profile type exif" text chunk (ImageMagick
    writes them), which Pillow reads and the loaders do not."""
    from PIL import PngImagePlugin

    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    raw = exif.tobytes().hex()
    info = PngImagePlugin.PngInfo()
    info.add_text("Raw profile type exif", f"\nexif\n{len(raw) // 2:8d}\n{raw}\n")
    out = io.BytesIO()
    img.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


@pytest.mark.backend
def test_an_orientation_the_loaders_do_not_read_turns_nothing_when_resized(tmp_path):
    """Orientations only in XMP or in a PNG's text chunk: the loaders leave such an image as
    stored, and so does --max-side (large images of a dataset are not turned where the small
    ones are not): the resized image is the stored one, and loads as the original does."""
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    out = io.BytesIO()
    photo(8, 200, 100).save(out, format="JPEG", quality=95, xmp=XMP_TURNED)
    files = {"xmp.jpg": out.getvalue(), "raw.png": raw_profile_png(photo(9, 200, 100), 6)}
    for name, data in files.items():
        with Image.open(io.BytesIO(data)) as img:
            assert img.getexif().get(ORIENTATION) == 6  # Pillow turns it
        (src / name).write_bytes(data)
    run_tool("make_shards", "imagefolder", tmp_path / "src", tmp_path / "plain", check=True)
    got = convert(tmp_path / "src", tmp_path / "small", "--max-side", 64)
    for name, data in files.items():
        with Image.open(io.BytesIO(got[name.split(".")[0]]["jpg"])) as img:
            assert img.size == (64, 32), name  # stored as it was: wide, not turned
            small = np.asarray(img.convert("RGB")).astype(int)
        with Image.open(io.BytesIO(data)) as img:
            want = np.asarray(img.convert("RGB").resize((64, 32), Image.LANCZOS)).astype(int)
        assert np.abs(small - want).mean() < 3, name
    loaded = []
    for folder in ("plain", "small"):
        with image_loader(str(tmp_path / folder), batch_size=1, size=16, device="cpu",
                          train=False, crop_fraction=1.0, reader="stream", backend="portable",
                          use_tuning=False, threads=1) as loader:
            loaded.append({b.keys[0]: b.image[0].float() for b in loader})
    for key in loaded[0]:
        assert (loaded[0][key] - loaded[1][key]).abs().mean() < 6, key  # no turn on either


def test_a_jpeg_resized_by_its_draft_alone_is_counted_resized(tmp_path):
    """A JPEG exactly 2x the side (the DCT draft at 1/2 gives N already) is as resized as
    any other, and the summary does not call --max-side's work a repair."""
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    (src / "square.jpg").write_bytes(saved(photo(5, 512, 512), "JPEG"))
    (src / "wide.jpg").write_bytes(saved(photo(6, 500, 300), "JPEG"))
    (src / "small.jpg").write_bytes(saved(photo(7, 200, 100), "JPEG"))
    out = tmp_path / "out"
    proc = run_tool("make_shards", "imagefolder", tmp_path / "src", out, "--max-side", 256,
                    "--reencode-all", check=True)
    sizes = {s["__key__"]: Image.open(io.BytesIO(s["jpg"])).size for s in read_wds(out)}
    assert sizes == {"c_square": (256, 256), "c_wide": (256, 154), "c_small": (200, 100)}
    assert json.loads((out / "manifest.json").read_text())["reencoded"] == {
        "resized": 2, "reencoded-at-quality": 1}
    assert "--max-side: reencoded-at-quality=1, resized=2" in proc.stdout
    assert "would refuse" not in proc.stdout


def masked_photo(orientation: int) -> tuple[bytes, bytes]:
    """A 64x48 JPEG, left half red, with an EXIF orientation, and its mask (1 where red) as
    stored: aligned with the stored pixels, as masks are (pipeline/samples/masks.py)."""
    arr = np.zeros((48, 64, 3), np.uint8)
    arr[:, :32] = (220, 30, 30)
    mask = np.zeros((48, 64), np.uint8)
    mask[:, :32] = 1
    out = io.BytesIO()
    Image.fromarray(mask, "L").save(out, format="PNG")
    return saved(Image.fromarray(arr), "JPEG", orientation), out.getvalue()


@pytest.mark.backend
def test_segmentation_shards_keep_image_and_mask_aligned(tmp_path):
    """make_shards shards --max-side over images with masks: neither is resized or turned
    (a mask must fit its image), both stored as they were, counted kept-for-its-mask; verify
    passes and the loader's mask covers the red half of its image."""
    import webdataset as wds

    src = tmp_path / "src"
    src.mkdir()
    samples = {f"k{i}": masked_photo(orientation) for i, orientation in enumerate((1, 6))}
    with wds.TarWriter(str(src / "seg-000000.tar")) as sink:
        for key, (image, mask) in samples.items():
            sink.write({"__key__": key, "jpg": image, "seg.png": mask, "cls": b"0"})
    out = tmp_path / "out"
    run_tool("make_shards", "shards", src, out, "--max-side", 32, check=True)
    for sample in read_wds(out):
        assert (sample["jpg"], sample["seg.png"]) == samples[sample["__key__"]]
    assert json.loads((out / "manifest.json").read_text())["reencoded"] == {
        "kept-for-its-mask": 2}
    run_tool("verify_shards", out, "--jobs", 1, check=True)
    with image_loader(str(out), batch_size=2, size=16, device="cpu", train=False,
                      reader="stream", backend="portable", use_tuning=False, threads=1,
                      targets={"mask": "seg.png"}) as loader:
        (batch,) = list(loader)
    red = (batch.image[:, 0] > 128) & (batch.image[:, 1] < 100)
    assert (red == (batch.targets["mask"] == 1)).float().mean() > 0.9


def test_only_samples_of_one_image_are_downsized():
    """repair_sample, which make_shards shards runs per sample: an image beside a second
    image member (a mask under another name) is kept as it is, one alone is resized."""
    from shardflow.samples.checks import CheckLimits, repair_sample
    from shardflow.samples.downsize import Downsize

    limits = CheckLimits(downsize=Downsize(32))
    image, mask = masked_photo(1)
    paired = repair_sample({"__key__": "a", "jpg": image, "png": mask}, limits)
    assert (paired["jpg"], paired["png"]) == (image, mask)
    assert paired["__repairs__"] == ("kept-for-its-mask",)
    alone = repair_sample({"__key__": "b", "jpg": image}, limits)
    assert Image.open(io.BytesIO(alone["jpg"])).size == (32, 24)
    assert alone["__repairs__"] == ("resized",)
    small = repair_sample({"__key__": "c", "jpg": image, "png": mask},
                          CheckLimits(downsize=Downsize(64)))
    assert "__repairs__" not in small  # within N: nothing was asked of --max-side


def test_a_bomb_beside_an_image_is_a_named_skip_with_max_side_as_without():
    """A second image member declaring 30000 x 30000 pixels: the sizes --max-side looks at are
    read from headers, so the member's own check names it (too-many-pixels, with the key),
    not a DecompressionBombError out of PIL."""
    import struct
    import zlib

    from shardflow.errors import DataError
    from shardflow.samples.checks import CheckLimits, repair_sample
    from shardflow.samples.downsize import Downsize

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + \
            struct.pack(">I", zlib.crc32(kind + body))

    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0,
                                                                0, 0)) + \
        chunk(b"IDAT", zlib.compress(bytes(100))) + chunk(b"IEND", b"")
    image, _ = masked_photo(1)
    for downsize in (None, Downsize(32)):
        with pytest.raises(DataError, match=r"key 'k'.*\[too-many-pixels\]"):
            repair_sample({"__key__": "k", "__url__": "s.tar", "jpg": image, "depth.png": bomb},
                          CheckLimits(downsize=downsize))


def test_max_side_with_mask_column_is_refused_saying_why(tmp_path):
    listing = tmp_path / "list.csv"
    listing.write_text("path,label,mask\na.jpg,0,a.png\n")
    proc = run_tool("make_shards", "manifest", listing, tmp_path / "out", "--mask-column",
                    "mask", "--max-side", 32)
    assert proc.returncode != 0 and "keeps its size" in proc.stderr
