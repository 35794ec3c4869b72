"""Real-world data: whatever make_shards accepts, the loaders read (issue 13).

Real files made here: PIL writes EXIF, CMYK, progressive, 16-bit quantisation tables, MPO,
16-bit, palette, tRNS and LA PNGs; byte surgery makes the JPEGs PIL decodes and DALI or the
loader's header parser refuse. The real tools (make_shards, verify_shards, train) run as
subprocesses and the real loaders with device="cpu".
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import load_manifest, run_tool
from PIL import Image

from shardflow import image_loader, pointcloud_loader, text_loader
from shardflow.convert import ConvertConfig, convert
from shardflow.errors import DataError
from shardflow.image import graph as image_graph
from shardflow.loading.readers import dali_importable
from shardflow.samples import headers
from shardflow.samples.checks import (
    CheckLimits,
    check_image,
    loader_problem,
    prepare_image,
    reencode_jpeg,
)
from shardflow.shards.manifest import LabelStats, Manifest
from shardflow.shards.manifest import load_manifest as read_manifest
from shardflow.shards.writer import ShardWriter

# -- images: the files ---------------------------------------------------------------------------


def photo(mode: str = "RGB", size: tuple[int, int] = (64, 48), seed: int = 0) -> Image.Image:
    """A gradient with noise: smooth enough to compress like a photo, noisy enough that a
    decoder does real work."""
    w, h = size
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 127, w * h * 3).reshape(h, w, 3).astype(np.uint8)
    return Image.fromarray(ramp + rng.integers(0, 128, (h, w, 3), dtype=np.uint8)).convert(mode)


def encode(img: Image.Image, fmt: str = "JPEG", **options: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **options)
    return out.getvalue()


def base() -> bytes:
    return encode(photo(), quality=85)


def after_soi(insert: bytes) -> bytes:
    data = base()
    return data[:2] + insert + data[2:]


def before_scan(insert: bytes) -> bytes:
    data = base()
    sos = data.index(b"\xff\xda")
    return data[:sos] + insert + data[sos:]


def short_jfif() -> bytes:
    """The JFIF APP0 segment replaced by one too short for PIL's parser (libjpeg ignores it)."""
    data = base()
    assert data[2:4] == b"\xff\xe0"
    app0_end = 4 + int.from_bytes(data[4:6], "big")
    return data[:2] + b"\xff\xe0\x00\x08JFIF\x00\x01" + data[app0_end:]


def exif_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90
    return encode(photo(), quality=85, exif=exif.tobytes())


def qtables16() -> bytes:
    """Quantisation tables with values above 255: stored with 16-bit precision (Pq=1), which
    makes the frame extended sequential (SOF1)."""
    tables = [[300 + i for i in range(64)], [400 + i for i in range(64)]]
    return encode(photo(), qtables=tables)


def mpo() -> bytes:
    return encode(photo(), "MPO", save_all=True, append_images=[photo(seed=5)], quality=85)


def palette_trns() -> bytes:
    return encode(photo().convert("P"), "PNG", transparency=0)


# An Adobe APP14 segment whose length field (12) is 2 short of the 14 bytes written: the last
# two bytes are left between segments.
ADOBE_SHORT = b"\xff\xee\x00\x0cAdobe\x00\x64\x00\x00\x00\x00\x01"

# name -> (file bytes, what make_shards does: ("kept", ext) or ("repaired", reason, ext))
ODD_BUT_VALID = {
    "exif.jpg": (exif_jpeg, ("kept", "jpg")),
    "cmyk.jpg": (lambda: encode(photo("CMYK"), quality=90), ("kept", "jpg")),
    "progressive.jpg": (lambda: encode(photo(), quality=85, progressive=True), ("kept", "jpg")),
    "qtables16.jpg": (qtables16, ("kept", "jpg")),
    "stereo.jpg": (mpo, ("kept", "jpg")),
    "upper.JPEG": (base, ("kept", "jpg")),
    "deep.png": (lambda: encode(Image.fromarray(np.arange(48 * 64, dtype=np.uint16)
                                                .reshape(48, 64) * 20), "PNG"), ("kept", "png")),
    "palette.png": (lambda: encode(photo().convert("P"), "PNG"), ("kept", "png")),
    "trns.png": (palette_trns, ("kept", "png")),
    "la.png": (lambda: encode(photo("LA"), "PNG"), ("kept", "png")),
    "png_named.jpg": (lambda: encode(photo(), "PNG"), ("kept", "png")),
    "jpeg_named.png": (base, ("kept", "jpg")),
    "prefixed.jpg": (lambda: b"\x00" * 16 + base(), ("repaired", "bytes-before-soi", "jpg")),
    "ff00.jpg": (lambda: after_soi(b"\xff\x00"), ("repaired", "jpeg-header-junk", "jpg")),
    "ff00_scan.jpg": (lambda: before_scan(b"\xff\x00"), ("repaired", "jpeg-header-junk", "jpg")),
    "adobe_short.jpg": (lambda: after_soi(ADOBE_SHORT), ("repaired", "jpeg-header-junk", "jpg")),
    "restart.jpg": (lambda: after_soi(b"\xff\xd0"), ("repaired", "jpeg-header-junk", "jpg")),
    "jfif_short.jpg": (short_jfif, ("repaired", "short-app-segment", "jpg")),
    "anim.gif": (lambda: encode(photo().convert("P"), "GIF"), ("repaired", "gif-to-png", "png")),
    "trns.gif": (lambda: encode(photo().convert("P"), "GIF", transparency=0),
                 ("repaired", "gif-to-png", "png")),
}
# The header-junk repairs remove exactly what the surgery added: the base JPEG comes back.
BACK_TO_BASE = ("prefixed.jpg", "ff00.jpg", "ff00_scan.jpg", "adobe_short.jpg", "restart.jpg")


def pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGBA"))


def dali_decodes(data: bytes) -> bool:
    """Whether the image loader's own decode graph (ROI decode of the whole image, CPU)
    decodes these bytes."""
    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
    graph = image_graph.build(image_graph.GraphSpec(size=32, device="cpu", resize=False),
                              batch_size=1, num_threads=1, device_id=None, seed=0)
    graph.feed_input("encoded", [np.frombuffer(data, np.uint8)])
    graph.feed_input("anchor", [np.array([0, 0], np.int32)])
    graph.feed_input("shape", [np.array([width, height], np.int32)])
    try:
        graph.run()
    except RuntimeError:
        return False
    return True


def header_reads(data: bytes) -> bool:
    try:
        headers.header_size(data)
    except DataError:
        return False
    return True


def test_the_strict_rule_matches_what_dali_and_the_header_parser_refuse():
    """Found with these files: DALI's CPU decode and the header parser refuse only the JPEGs
    with bytes between header segments (FF00 after SOI or before the scan, an APP14 segment
    whose length is too short, a restart marker before the scan); CMYK, progressive, 16-bit
    quantisation tables, MPO, EXIF and every PNG kind decode. The rule agrees on every file."""
    refused = set()
    for name, (make, _) in ODD_BUT_VALID.items():
        data = make()
        if name in ("prefixed.jpg", "jfif_short.jpg", "anim.gif", "trns.gif"):
            continue  # PIL cannot open the first two; the header parser takes no GIF
        fmt = Image.open(io.BytesIO(data)).format
        strict = loader_problem(data, str(fmt)) is None
        loader = dali_decodes(data) and header_reads(data)
        assert strict == loader, (name, strict, loader)
        if not loader:
            refused.add(name)
    assert refused == {"ff00.jpg", "ff00_scan.jpg", "adobe_short.jpg", "restart.jpg"}
    # the header parser alone fails where the junk comes before the frame header
    assert not header_reads(after_soi(ADOBE_SHORT)) and header_reads(before_scan(b"\xff\x00"))
    assert b"\xff\xc1" in qtables16() and Image.open(io.BytesIO(mpo())).format == "MPO"


def test_unreadable_files_stay_refused_not_repaired():
    limits = CheckLimits()
    for data in (b"\x00" * 5000 + base(),  # the start-of-image marker past the 4 KiB looked at
                 b"GIF" + base()[3:],  # neither a JPEG nor anything else
                 base()[:400]):  # truncated
        with pytest.raises(DataError) as info:
            prepare_image(data, limits)
        assert info.value.reason == "bad-image", data[:8]


def test_reencoding_keeps_gray_and_exif():
    gray = encode(photo("L"), quality=80)
    out = Image.open(io.BytesIO(reencode_jpeg(gray)))
    assert out.format == "JPEG" and out.mode == "L"
    cmyk = Image.open(io.BytesIO(reencode_jpeg(encode(photo("CMYK"), quality=90,
                                                      exif=Image.open(io.BytesIO(
                                                          exif_jpeg())).info["exif"]))))
    assert cmyk.mode == "RGB" and cmyk.getexif()[0x0112] == 6


def test_a_palette_gif_stays_a_palette_png_with_its_indices():
    """The loaders read a palette PNG as they read the GIF; a label map kept as GIF keeps its
    labels (its palette indices), which RGB would have lost."""
    for options in ({}, {"transparency": 0}):
        gif = encode(photo().convert("P"), "GIF", **options)
        stored = prepare_image(gif, CheckLimits())
        assert (stored.ext, stored.repairs) == ("png", ("gif-to-png",))
        with Image.open(io.BytesIO(stored.data)) as png, Image.open(io.BytesIO(gif)) as src:
            assert png.mode == "P" and np.array_equal(np.asarray(png), np.asarray(src))
            assert np.array_equal(np.asarray(png.convert("RGB")), np.asarray(src.convert("RGB")))


def odd_folder(root: Path) -> Path:
    for i, (name, (make, _)) in enumerate(ODD_BUT_VALID.items()):
        folder = root / f"class{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(make())
    (root / "class0" / "far_prefix.jpg").write_bytes(b"\x00" * 5000 + base())
    return root


def stem_key(name: str, classes: int = 3) -> str:
    index = list(ODD_BUT_VALID).index(name)
    return f"class{index % classes}_{name.rsplit('.', 1)[0]}"


def read_all_images(source: Path, **options: object) -> tuple[list[str], list]:
    keys = []
    with image_loader(source, batch_size=8, device="cpu", train=False, size=32,
                      use_tuning=False, **options) as loader:
        for batch in loader:
            assert batch.image.shape[1:] == (3, 32, 32)
            keys += batch.keys
        return keys, list(loader.skipped)


def test_make_shards_repairs_counts_and_the_loader_reads_every_sample(tmp_path):
    from conftest import read_wds

    src, out = odd_folder(tmp_path / "src"), tmp_path / "out"
    proc = run_tool("make_shards", "imagefolder", src, out, "--workers", 1, "--quiet",
                    "--on-error", "skip")
    assert proc.returncode == 0, proc.stderr
    manifest = load_manifest(out)
    want: dict[str, int] = {}
    for _, outcome in ODD_BUT_VALID.values():
        if outcome[0] == "repaired":
            want[outcome[1]] = want.get(outcome[1], 0) + 1
    assert manifest["reencoded"] == want
    assert "repaired images the loaders would refuse" in proc.stdout
    assert [(s["source"].rsplit("/", 1)[-1], s["reason"]) for s in manifest["skipped"]] == \
        [("far_prefix.jpg", "bad-image")]
    stored = {s["__key__"]: s for s in read_wds(out)}
    for name, (make, outcome) in ODD_BUT_VALID.items():
        sample, original = stored[stem_key(name)], make()
        ext = outcome[-1]
        assert ext in sample, (name, sorted(sample))
        if outcome[0] == "kept":
            assert sample[ext] == original, name  # byte for byte
        elif name in BACK_TO_BASE:
            assert sample[ext] == base(), name  # the surgery undone, nothing re-encoded
        else:  # lossless: PIL cannot open the short-JFIF original; the rest is base()'s
            reference = base() if name == "jfif_short.jpg" else original
            assert np.array_equal(pixels(sample[ext]), pixels(reference)), name
    assert run_tool("verify_shards", out).returncode == 0
    keys, skipped = read_all_images(out)
    assert sorted(keys) == sorted(stem_key(n) for n in ODD_BUT_VALID) and skipped == []


def foreign_shard(out: Path) -> dict[str, str]:
    """A shard written without make_shards (its own index, so the DALI reader takes it) with
    members the loaders repair as they read (header junk: jpegscan.readable) and one they
    refuse; returns key -> the reason verify_shards gives for those it names."""
    out.mkdir(parents=True)
    writer = ShardWriter(out, "foreign", max_count=100, max_size=2**30)
    members = {"good": ("jpg", base(), None),
               "ff00": ("jpg", after_soi(b"\xff\x00"), None),
               "adobe": ("jpg", after_soi(ADOBE_SHORT), None),
               "anim": ("gif", encode(photo().convert("P"), "GIF"), "unsupported-image-format")}
    for i, (key, (ext, data, _)) in enumerate(members.items()):
        writer.write({"__key__": key, ext: data, "cls": str(i * 3).encode()})
    writer.finish()
    return {key: reason for key, (_, _, reason) in members.items() if reason}


def test_verify_reports_what_the_loader_refuses_and_resharding_repairs_it(tmp_path):
    bad = foreign_shard(tmp_path / "foreign")
    proc = run_tool("verify_shards", tmp_path / "foreign")
    assert proc.returncode == 1
    for key, reason in bad.items():
        assert f"foreign-000000.tar key '{key}'" in proc.stdout, proc.stdout
        assert reason in proc.stdout
    assert "problems by reason: unsupported-image-format=1" in proc.stdout
    # The loader, under the same rule, on either backend, skips exactly the sample named and
    # reads the header junk repaired.
    for backend in ("dali", "portable") if dali_importable() else ("portable",):
        keys, skipped = read_all_images(tmp_path / "foreign" / "foreign-000000.tar",
                                        on_error="skip", num_classes=10, backend=backend)
        assert keys == ["good", "ff00", "adobe"] and [s["key"] for s in skipped] == ["anim"]
    # Re-sharding repairs them: the GIF member becomes .png, the header junk goes.
    out = tmp_path / "resharded"
    proc = run_tool("make_shards", "shards", tmp_path / "foreign", out, "--workers", 1,
                    "--quiet")
    assert proc.returncode == 0, proc.stderr
    manifest = load_manifest(out)
    assert manifest["reencoded"] == {"gif-to-png": 1, "jpeg-header-junk": 2}
    assert manifest["labels"] == {"distinct": 4, "min": 0, "max": 9,
                                  "ranges": [[0, 0], [3, 3], [6, 6], [9, 9]]}
    assert run_tool("verify_shards", out).returncode == 0
    keys, skipped = read_all_images(out, num_classes=10)
    assert sorted(keys) == ["adobe", "anim", "ff00", "good"] and skipped == []


def test_check_image_names_the_problem_and_the_fix():
    # Header junk PIL skips: one verdict with the loaders, which read it repaired
    assert check_image(after_soi(b"\xff\x00"), CheckLimits()) == "JPEG"
    with pytest.raises(DataError) as info:
        check_image(encode(photo().convert("P"), "GIF"), CheckLimits())
    assert info.value.reason == "unsupported-image-format"
    assert "`shardflow convert shards` rewrites them" in str(info.value)


# -- labels without a class map ------------------------------------------------------------------


def labelled_manifest(root: Path, labels: list[int]) -> Path:
    root.mkdir(parents=True)
    lines = ["path,label"]
    for i, label in enumerate(labels):
        (root / f"img{i}.jpg").write_bytes(encode(photo(seed=i), quality=80))
        lines.append(f"img{i}.jpg,{label}")
    (root / "list.csv").write_text("\n".join(lines) + "\n")
    return root / "list.csv"


def test_label_statistics_for_every_labelled_kind_and_parts(tmp_path):
    src = labelled_manifest(tmp_path / "src", [7, 0, 3, 3, 0, 7])
    for part in ("0/2", "1/2"):
        run_tool("make_shards", "manifest", src, tmp_path / "parts", "--part", part,
                 "--workers", 1, "--quiet", check=True)
    parts = [json.loads(p.read_text()) for p in sorted((tmp_path / "parts").glob(
        "manifest.part-*.json"))]
    assert [p["labels"]["ranges"] for p in parts] == [[[0, 0], [3, 3], [7, 7]], [[0, 0], [3, 3],
                                                                                [7, 7]]]
    merged = run_tool("make_shards", "merge", tmp_path / "parts", check=True)
    assert "merged" in merged.stdout
    assert load_manifest(tmp_path / "parts")["labels"] == {
        "distinct": 3, "min": 0, "max": 7, "ranges": [[0, 0], [3, 3], [7, 7]]}
    # imagefolder (with a class map) and pointcloud record them too; text has none
    convert(ConvertConfig(kind="imagefolder", src=str(odd_folder(tmp_path / "folder")),
                          out=tmp_path / "f", workers=1, on_error="skip"))
    assert read_manifest(str(tmp_path / "f" / "manifest.json")).labels == \
        LabelStats(((0, 2),))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("a document")
    convert(ConvertConfig(kind="text", src=str(tmp_path / "docs"), out=tmp_path / "t",
                          workers=1))
    assert load_manifest(tmp_path / "t")["labels"] is None


class Stop(Exception):
    """Raised from the progress callback: a conversion stopped after some shards."""


def test_repairs_and_labels_are_counted_once_across_a_resume(tmp_path):
    src = odd_folder(tmp_path / "src")

    def run(out: Path, stop_at: int | None = None) -> Manifest:
        def progress(samples: int, _bytes: int, _total: int | None) -> None:
            if samples == stop_at:
                raise Stop

        return convert(ConvertConfig(kind="imagefolder", src=str(src), out=out, max_count=1,
                                     workers=1, on_error="skip"), progress)

    whole = run(tmp_path / "whole").to_json()
    # Stop right after a repaired image, the first of its shard: the journal, saved as it
    # arrived, must not count it, since the rerun converts it again.
    written = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.*")
                     if p.name != "far_prefix.jpg")
    stop_at = next(i for i, rel in enumerate(written, 1)
                   if i > 1 and ODD_BUT_VALID[rel.split("/")[1]][1][0] == "repaired")
    with pytest.raises(Stop):
        run(tmp_path / "out", stop_at=stop_at)
    journal = tmp_path / "out" / ".make_shards.journal.json"
    assert len(json.loads(journal.read_text())["shards"]) == stop_at - 1
    resumed = run(tmp_path / "out").to_json()
    for field in ("reencoded", "labels", "skipped_counts", "total_samples"):
        assert resumed[field] == whole[field], field
    # A journal written before labels were recorded: the labels of its shards are unknown.
    with pytest.raises(Stop):
        run(tmp_path / "old", stop_at=11)
    doc = json.loads((tmp_path / "old" / ".make_shards.journal.json").read_text())
    for field in ("labels", "reencoded", "offset_clouds"):
        doc.pop(field)
    (tmp_path / "old" / ".make_shards.journal.json").write_text(json.dumps(doc))
    old = run(tmp_path / "old")
    assert old.labels is None and old.total_samples == whole["total_samples"]


def test_manifest_without_the_new_fields_still_loads():
    old = {"format_version": 1, "modality": "image", "total_samples": 1, "classes": None,
           "shards": [{"name": "a.tar", "samples": 1, "bytes": 10, "sha256": "0" * 64}]}
    m = Manifest.from_json(old)
    assert m.labels is None and m.reencoded == {} and m.offset_clouds == 0
    assert Manifest.from_json(m.to_json()).to_json() == m.to_json()


def test_train_takes_classes_from_label_statistics_or_num_classes(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    src = labelled_manifest(tmp_path / "src", [0, 4, 2, 4, 0, 2, 4, 0])
    data = tmp_path / "shards"
    run_tool("make_shards", "manifest", src, data, "--max-count", 2, "--workers", 1,
             "--quiet", check=True)
    common = ["--task", "image", "--data", data, "--steps", 2, "--batch-size", 2, "--size", 32,
              "--device", "cpu", "--precision", "fp32", "--quiet"]
    run_tool("train", *common, "--out", tmp_path / "r1", check=True)
    # Without statistics (a manifest from before they were recorded): --num-classes decides.
    doc = load_manifest(data)
    doc.pop("labels")
    (data / "manifest.json").write_text(json.dumps(doc))
    refused = run_tool("train", *common, "--out", tmp_path / "r2")
    assert refused.returncode != 0 and "--num-classes" in refused.stderr, refused.stderr
    run_tool("train", *common, "--out", tmp_path / "r3", "--num-classes", 5, check=True)
    small = run_tool("train", *common, "--out", tmp_path / "r4", "--num-classes", 3)
    assert small.returncode != 0 and "label" in (small.stderr + small.stdout)


def test_num_classes_must_agree_with_the_statistics(tmp_path):
    from shardflow.loading.shardlist import resolve_source
    from shardflow.trainers.wiring import TaskOptions, _classes

    src = labelled_manifest(tmp_path / "src", [1, 5])
    convert(ConvertConfig(kind="manifest", src=str(src), out=tmp_path / "s", workers=1))
    source = resolve_source(tmp_path / "s")
    opts = TaskOptions(task="image", data=str(tmp_path / "s"))
    assert _classes(opts, source) == 6
    assert _classes(TaskOptions(task="image", data=str(tmp_path / "s"), num_classes=9),
                    source) == 9
    with pytest.raises(ValueError, match="--num-classes 4 disagrees .*labels up to 5"):
        _classes(TaskOptions(task="image", data=str(tmp_path / "s"), num_classes=4), source)


# -- a GPT-2 style tokenizer ---------------------------------------------------------------------

DOCS = ["the cat sat on the mat", "a dog ran in the park", "hello world, hello shards",
        "tokens without a pad token"]


def gpt2_tokenizer(path: Path) -> Path:
    """A byte-level BPE trained on a few strings with `<|endoftext|>` as its only special
    token, as GPT-2's tokenizer.json has: no pad, no mask."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(DOCS * 10, trainer=trainer)
    tok.save(str(path))
    return path


@pytest.fixture
def text_shards(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(24):
        (docs / f"d{i:02d}.txt").write_text(" ".join(DOCS[j % 4] for j in range(i, i + 3)))
    convert(ConvertConfig(kind="text", src=str(docs), out=tmp_path / "shards", max_count=6,
                          workers=1))
    return tmp_path / "shards"


def test_gpt2_style_tokenizer_reads_for_clm_and_pads_with_end_of_text(text_shards, tmp_path):
    path = gpt2_tokenizer(tmp_path / "tokenizer.json")
    eos = json.loads(path.read_text())["added_tokens"][0]["id"]
    rows = []
    with text_loader(text_shards, batch_size=4, seq_len=16, objective="clm", tokenizer=path,
                     device="cpu", use_tuning=False) as loader:
        assert loader.tokenizer.pad_id == loader.tokenizer.sep_id == eos
        for batch in loader:
            rows.append(batch)
    last = rows[-1]
    pad = last.attention_mask == 0
    assert pad.any(), "the epoch's last batch should be padded"
    assert (last.input_ids[pad] == eos).all() and (last.labels[pad] == -100).all()
    assert all((b.labels[b.attention_mask == 1] >= 0).all() for b in rows)
    with pytest.raises(ValueError, match="pad_token='<pad>'"):
        text_loader(text_shards, batch_size=4, tokenizer=path, pad_token="<pad>")
    with pytest.raises(ValueError, match="mask token"):
        text_loader(text_shards, batch_size=4, objective="mlm", tokenizer=path)


def test_train_runs_causal_lm_with_a_gpt2_style_tokenizer(text_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = gpt2_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "run"
    run_tool("train", "--task", "text", "--objective", "clm", "--data", text_shards, "--out",
             out, "--tokenizer", path, "--pad-token", "<|endoftext|>", "--steps", 3,
             "--batch-size", 4, "--seq-len", 16, "--device", "cpu", "--precision", "fp32",
             "--quiet", check=True)
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


# -- point clouds far from the origin ------------------------------------------------------------


def geo_cloud(seed: int, n: int = 200) -> np.ndarray:
    """Points of a 100 m x 100 m x 30 m tile in a projected CRS (metres, 5e6 from the origin),
    at millimetre resolution: what LiDAR tiles hold."""
    rng = np.random.default_rng(seed)
    xyz = np.stack([5_123_000 + rng.uniform(0, 100, n), 4_456_000 + rng.uniform(0, 100, n),
                    120 + rng.uniform(0, 30, n)], axis=1)
    return np.round(xyz, 3)


def write_xyz(path: Path, xyz: np.ndarray) -> None:
    path.write_text("".join(f"{x:.3f} {y:.3f} {z:.3f}\n" for x, y, z in xyz))


def write_ply_double(path: Path, xyz: np.ndarray) -> None:
    header = (f"ply\nformat binary_little_endian 1.0\nelement vertex {len(xyz)}\n"
              "property double x\nproperty double y\nproperty double z\nend_header\n")
    path.write_bytes(header.encode() + xyz.astype("<f8").tobytes())


def test_geographic_clouds_keep_their_precision_and_plain_ones_are_unchanged(tmp_path):
    src, truth = tmp_path / "src", {}
    for c in range(2):
        (src / f"c{c}").mkdir(parents=True)
        truth[f"c{c}_tile"] = geo_cloud(c)
        write_xyz(src / f"c{c}" / "tile.xyz", truth[f"c{c}_tile"])
        truth[f"c{c}_scan"] = geo_cloud(10 + c)
        write_ply_double(src / f"c{c}" / "scan.ply", truth[f"c{c}_scan"])
        truth[f"c{c}_plain"] = np.random.default_rng(c).normal(size=(200, 3)).astype(np.float32)
        np.save(src / f"c{c}" / "plain.npy", truth[f"c{c}_plain"])
    # what a straight float32 cast does to such a cloud
    tile = truth["c0_tile"]
    assert np.abs(tile.astype(np.float32) - tile).max() > 1e-3 * np.ptp(tile, axis=0).max()
    out = tmp_path / "out"
    proc = run_tool("make_shards", "pointcloud", src, out, "--workers", 1, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert load_manifest(out)["offset_clouds"] == 4
    assert run_tool("verify_shards", out).returncode == 0
    for reader in ("dali", "stream"):
        seen = set()
        with pointcloud_loader(out, batch_size=4, device="cpu", train=False, normalize=False,
                               num_points=200, reader=reader, use_tuning=False) as loader:
            for batch in loader:
                assert batch.offset.dtype == torch_float64() and batch.offset.shape[1] == 3
                for key, points, offset in zip(batch.keys, batch.points, batch.offset,
                                               strict=True):
                    seen.add(key)
                    want = truth[key]
                    if key.endswith("plain"):
                        assert not offset.any() and np.array_equal(points.numpy(), want)
                        continue
                    got = points.double().numpy() + offset.numpy()
                    extent = np.ptp(want, axis=0).max()
                    assert np.abs(got - want).max() <= 1e-6 * extent, (reader, key)
        assert seen == set(truth), reader


def torch_float64():
    import torch

    return torch.float64


def test_a_bad_offset_member_is_named(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    writer = ShardWriter(out, "pc", max_count=10, max_size=2**30)
    cloud = io.BytesIO()
    np.save(cloud, np.random.default_rng(0).normal(size=(20, 3)).astype(np.float32))
    short = io.BytesIO()
    np.save(short, np.zeros(2))
    writer.write({"__key__": "k0", "npy": cloud.getvalue(), "offset.npy": short.getvalue(),
                  "cls": b"0"})
    writer.finish()
    proc = run_tool("verify_shards", out)
    assert proc.returncode == 1 and "key 'k0'" in proc.stdout and "[bad-format]" in proc.stdout
    assert "3 finite float64" in proc.stdout
    with pytest.raises(DataError, match="k0.*3 finite float64|3 finite float64.*k0"), \
            pointcloud_loader(out / "pc-000000.tar", batch_size=2, device="cpu",
                              num_classes=1, use_tuning=False) as loader:
        next(iter(loader))
