"""One verdict per sample: index, verify, the loaders on both backends and ShardDataset read
the same bytes alike, on shards written by other tools (webdataset's TarWriter, GNU tar,
PIL's JPEGs)."""

from __future__ import annotations

import io
import json
import logging
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import QuietHandler, http_server, jpeg_bytes, run_tool
from PIL import Image

from shardflow import ShardDataset, collate_skipping, image_loader, text_loader
from shardflow.errors import DataError
from shardflow.loading.readers import dali_importable

wds = pytest.importorskip("webdataset")

BACKENDS = ("dali", "portable") if dali_importable() else ("portable",)


def write_shard(path: Path, samples: list[dict]) -> None:
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)


def labelled(prefix: str, n: int, seed: int = 0) -> list[dict]:
    return [{"__key__": f"{prefix}{i}", "jpg": jpeg_bytes(seed + i), "cls": b"%d" % (i % 3),
             "txt": f"a photo of {prefix} number {i}".encode()} for i in range(n)]


def read(source: object, backend: str, **kw: object) -> tuple[list[str], list[tuple[str, str]]]:
    """Keys read (in order) and (key, reason) of each skip, by image_loader."""
    with image_loader(source, batch_size=4, size=16, train=False, backend=backend,
                      use_tuning=False, threads=1, **kw) as loader:
        keys = [k for batch in loader for k in batch.keys]
        return keys, [(e["key"], e["reason"]) for e in loader.skipped]


# -- empty shards -----------------------------------------------------------------------------

def empty_shards(folder: Path) -> None:
    """An empty TarWriter and GNU tar of an empty folder, beside two shards of samples."""
    folder.mkdir(parents=True)
    write_shard(folder / "a-000000.tar", labelled("a", 5))
    write_shard(folder / "a-000001.tar", [])
    write_shard(folder / "a-000002.tar", labelled("b", 3, seed=10))
    tar = shutil.which("tar")
    if tar is not None:
        (folder.parent / "nothing").mkdir()
        subprocess.run([tar, "-cf", str(folder / "a-000003.tar"), "-C",
                        str(folder.parent / "nothing"), "."], check=True)


@pytest.mark.backend
def test_an_empty_shard_is_a_shard_of_no_samples_everywhere(tmp_path):
    folder = tmp_path / "wds"
    empty_shards(folder)
    run_tool("make_shards", "index", folder, "--quiet", check=True)
    counts = {s["name"]: s["samples"] for s in
              json.loads((folder / "manifest.json").read_text())["shards"]}
    assert counts["a-000001.tar"] == 0 and sum(counts.values()) == 8
    proc = run_tool("verify_shards", folder, "--world-size", "2")
    assert proc.returncode == 0 and "8 samples" in proc.stdout, proc.stdout
    want = {f"a{i}" for i in range(5)} | {f"b{i}" for i in range(3)}
    for backend in BACKENDS:  # DALI's reader refused the empty index at build
        for reader in ("auto", "stream", "index"):
            keys, skips = read(folder, backend, reader=reader, on_error="skip")
            assert sorted(keys) == sorted(want) and skips == [], (backend, reader)
        halves = [read(folder, backend, rank=r, world_size=2)[0] for r in (0, 1)]
        assert set(halves[0]).isdisjoint(halves[1]) and all(halves)  # no rank gets nothing
        with text_loader(folder, batch_size=2, seq_len=16, backend=backend) as loader:
            assert {k for batch in loader for k in batch.keys} == want  # a key per piece
    assert len(ShardDataset(folder)) == 8


# -- a shard index leaves unindexed -------------------------------------------------------------

@pytest.mark.backend
def test_read_plus_skipped_is_the_folder_before_and_after_index_on_error_skip(tmp_path):
    folder = tmp_path / "wds"
    folder.mkdir()
    write_shard(folder / "a-000000.tar", labelled("a", 6))
    with wds.TarWriter(str(folder / "b-000000.tar.gz"), compress=True) as sink:
        for sample in labelled("b", 2, seed=20):
            sink.write(sample)
    spaced = [{"__key__": "IMG 0001", "jpg": jpeg_bytes(30), "cls": b"1"}]
    write_shard(folder / "c-000000.tar", spaced)  # a camera folder's names: no index holds them
    before = {b: read(folder, b) for b in BACKENDS}
    assert all(len(keys) == 9 and not skips for keys, skips in before.values())
    run_tool("make_shards", "index", folder, "--on-error", "skip", "--quiet", check=True)
    after = {b: read(folder, b) for b in BACKENDS}
    assert {b: sorted(k) for b, (k, _) in after.items()} == \
        {b: sorted(k) for b, (k, _) in before.items()}
    proc = run_tool("verify_shards", folder)
    assert proc.returncode == 0 and "9 samples (manifest: 9)" in proc.stdout, proc.stdout
    assert "b-000000.tar.gz [compressed-shard]" in proc.stdout
    assert "c-000000.tar [whitespace-name]" in proc.stdout


# -- a JPEG header with bytes libjpeg skips ----------------------------------------------------

def camera_jpeg(seed: int) -> bytes:
    """A photo with EXIF, as a camera writes it."""
    exif = Image.Exif()
    exif[0x010F] = "Camera"
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, 96, dtype=np.float32)[None, :, None]
    pixels = np.clip(ramp + rng.normal(0, 12, (72, 96, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90, exif=exif.tobytes())
    return out.getvalue()


@pytest.mark.backend
def test_a_jpeg_with_ff00_in_its_header_reads_alike_everywhere(tmp_path):
    clean = camera_jpeg(1)
    junk = clean[:2] + b"\xff\x00" + clean[2:]  # what some cameras' firmware writes
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(junk))),
                          np.asarray(Image.open(io.BytesIO(clean))))  # PIL skips it
    folder = tmp_path / "wds"
    folder.mkdir()
    write_shard(folder / "a-000000.tar", [{"__key__": "clean", "jpg": clean, "cls": b"0"},
                                         {"__key__": "junk", "jpg": junk, "cls": b"0"}])
    run_tool("make_shards", "index", folder, "--quiet", check=True)
    assert run_tool("verify_shards", folder).returncode == 0
    for backend in BACKENDS:
        with image_loader(folder, batch_size=2, size=64, train=False, backend=backend,
                          use_tuning=False) as loader:
            batch = next(iter(loader))
        assert batch.keys == ["clean", "junk"]
        assert torch_equal(batch.image[0], batch.image[1]), backend  # the same pixels
    ds = ShardDataset(folder)
    assert np.array_equal(ds.get("junk")["image"], np.asarray(Image.open(io.BytesIO(clean))))


def torch_equal(a: object, b: object) -> bool:
    import torch

    return bool(torch.equal(a, b))  # type: ignore[arg-type]


# -- a server without range requests --------------------------------------------------------------

def test_verify_reads_indexed_shards_behind_a_server_without_range_requests(tmp_path):
    folder = tmp_path / "wds"
    folder.mkdir()
    write_shard(folder / "a-000000.tar", labelled("a", 4))
    write_shard(folder / "a-000001.tar", labelled("b", 3, seed=5))
    run_tool("make_shards", "index", folder, "--quiet", check=True)
    with http_server(tmp_path, QuietHandler) as base:  # python -m http.server: no ranges
        proc = run_tool("verify_shards", f"{base}/wds", "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "7 samples (manifest: 7)" in proc.stdout
    # A stale index is still found: it points at bytes the stream did not find there.
    (folder / "a-000000.idx").write_text((folder / "a-000001.idx").read_text())
    with http_server(tmp_path, QuietHandler) as base:
        proc = run_tool("verify_shards", f"{base}/wds", "--quiet")
    assert proc.returncode == 1 and "a-000000.idx" in proc.stdout and "[bad-index]" in proc.stdout


# -- advice that works -------------------------------------------------------------------------

def test_a_gzipped_shard_is_sent_to_the_advice_that_works(tmp_path):
    folder = tmp_path / "gz"
    folder.mkdir()
    with wds.TarWriter(str(folder / "a-000000.tgz"), compress=True) as sink:
        for sample in labelled("a", 3):
            sink.write(sample)
    with pytest.raises(DataError, match="shardflow convert shards SRC DST") as told:
        ShardDataset(folder).get("a1")
    assert "shardflow index" not in str(told.value)
    run_tool("make_shards", "shards", folder, tmp_path / "plain", "--quiet", check=True)
    assert ShardDataset(tmp_path / "plain").get("a1")["label"] == 1


# -- text_loader and caption shards ------------------------------------------------------------

@pytest.mark.parametrize("captions", [True, False])
def test_text_loader_answers_alike_for_a_folder_and_a_pattern(tmp_path, captions):
    folder = tmp_path / "wds"
    folder.mkdir()
    samples = labelled("a", 4)
    for s in samples:
        if not captions:
            del s["txt"]
    write_shard(folder / "a-000000.tar", samples)
    run_tool("make_shards", "index", folder, "--quiet", check=True)
    for source in (folder, str(folder / "a-{000000..000000}.tar")):
        if captions:
            with text_loader(source, batch_size=2, seq_len=16) as loader:
                assert {k for b in loader for k in b.keys} == {f"a{i}" for i in range(4)}
        else:
            with pytest.raises(ValueError, match="hold image .*read them with image_loader"):
                text_loader(source, batch_size=2, seq_len=16)


# -- what only its name hides ------------------------------------------------------------------

def test_an_upper_case_shard_and_a_gzipped_member_are_named(tmp_path, caplog):
    folder = tmp_path / "wds"
    folder.mkdir()
    write_shard(folder / "a-000000.tar", labelled("a", 3))
    write_shard(folder / "LOUD-000001.TAR", labelled("b", 2))
    write_shard(folder / "z-000002.tar", [{"__key__": "z", "jpg": jpeg_bytes(3), "cls": b"1",
                                           "txt.gz": __import__("gzip").compress(b"hi")}])
    proc = run_tool("verify_shards", folder)
    assert proc.returncode == 1
    assert "rename it to LOUD-000001.tar [unlisted-shard]" in proc.stdout
    assert "gzipped members (z.txt.gz)" in proc.stdout
    with caplog.at_level(logging.WARNING):
        keys, _ = read(folder, "portable")
    assert len(keys) == 4 and "LOUD-000001.TAR" in caplog.text


# -- ShardDataset in a DataLoader ----------------------------------------------------------------

def test_the_dataloader_recipe_works_on_photos_of_their_own_sizes(tmp_path):
    from torch.utils.data import DataLoader, RandomSampler

    folder = tmp_path / "wds"
    folder.mkdir()
    write_shard(folder / "a-000000.tar", [
        {"__key__": f"p{i}", "jpg": jpeg_bytes(i, size=(40 + 8 * i, 30 + 4 * i)),
         "cls": b"%d" % i} for i in range(4)] + [{"__key__": "bad", "jpg": b"junk", "cls": b"0"}])
    run_tool("make_shards", "index", folder, "--quiet", check=True)
    ds = ShardDataset(folder, on_error="skip")
    loader = DataLoader(ds, batch_size=8, sampler=RandomSampler(ds), collate_fn=collate_skipping)
    batch = next(iter(loader))
    assert sorted(tuple(im.shape) for im in batch["image"]) == \
        [(30 + 4 * i, 40 + 8 * i, 3) for i in range(4)]
    assert sorted(batch["label"].tolist()) == [0, 1, 2, 3]
    assert [e["key"] for e in ds.skipped.entries] == ["bad"]


# -- the property: verify's verdict per sample is every reader's --------------------------------

def odd_members(seed: int) -> tuple[list[tuple[str, bytes]], bool]:
    """A shard's members drawn from `seed` (keys prefixed by it: unique across shards), and
    whether to gzip the whole shard. Every sample has a .cls, good or bad, so that verify (which
    knows no classes here) and the loaders (which read labels) judge the same members."""
    import gzip
    import random

    rng = random.Random(seed)
    members: list[tuple[str, bytes]] = []
    for i in range(rng.choice([0, 1, 3, 4, 5])):
        key = f"s{seed:04d}_{i}"
        image, label = jpeg_bytes(seed * 10 + i), b"%d" % rng.randrange(5)
        kind = rng.choice(["good", "good", "good", "upper", "zero", "junk", "cut", "ff00",
                           "badcls", "gzcls", "twice", "split"])
        ext, cls_name = "jpg", f"{key}.cls"
        if kind == "upper":
            ext = "JPG"
        elif kind == "zero":
            image = b""
        elif kind == "junk":
            image = bytes(rng.randrange(256) for _ in range(300))
        elif kind == "cut":
            image = image[: len(image) // 2]
        elif kind == "ff00":
            image = image[:2] + b"\xff\x00" + image[2:]
        elif kind == "badcls":
            label = b"seven"
        elif kind == "gzcls":
            cls_name, label = f"{key}.cls.gz", gzip.compress(label)
        members += [(f"{key}.{ext}", image), (cls_name, label)]
        if kind == "twice":
            members.append((cls_name, label))
        elif kind == "split" and i > 0:  # this key's label after the previous key's
            members[-1], members[-3] = members[-3], members[-1]
    return members, rng.random() < 0.1


Verdicts = dict[str, tuple[bool, frozenset[str]]]  # key -> (read, the reasons it was refused)


def verdicts(read: list[str], refused: list[dict]) -> Verdicts:
    """A key can be both: a key whose first copy is read and a later copy refused."""
    reasons: dict[str, set[str]] = {}
    for entry in refused:
        if entry["key"]:
            reasons.setdefault(entry["key"], set()).add(entry["reason"])
    return {k: (k in read, frozenset(reasons.get(k, ()))) for k in {*read, *reasons}}


def verdicts_of_verify(folder: Path) -> Verdicts:
    from shardflow.shards.verify import verify

    reports, _ = verify(str(folder))
    return verdicts([k for r in reports for k in r.keys if not any(
        p["key"] == k and p["reason"] not in ("split-key", "duplicate-key")
        for p in r.problems)], [p for r in reports for p in r.problems])


def verdicts_of_loader(folder: Path, backend: str) -> Verdicts:
    with image_loader(folder, batch_size=8, size=16, train=False, backend=backend,
                      reader="stream", on_error="skip", use_tuning=False) as loader:
        read = [k for b in loader for k in b.keys]
        return verdicts(read, list(loader.skipped))


def verdicts_of_dataset(folder: Path) -> Verdicts:
    """Over the shards `shardflow index` indexed (random access needs an index)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    urls = [str(folder / s["name"]) for s in manifest["shards"]
            if s["samples"] and "unindexed" not in s]
    if not urls:
        return {}
    ds = ShardDataset(urls, on_error="skip")
    read = [sample["__key__"] for sample in ds if sample is not None]
    return verdicts(read, ds.skipped.entries)


def odd_folder(folder: Path, seeds: range) -> None:
    import gzip

    from badfiles import tar_bytes

    folder.mkdir()
    for seed in seeds:
        members, packed = odd_members(seed)
        data = tar_bytes(members)
        name = f"odd-{seed:04d}.tar" + (".gz" if packed else "")
        (folder / name).write_bytes(gzip.compress(data) if packed else data)


def check_agreement(folder: Path) -> None:
    said = verdicts_of_verify(folder)
    for backend in BACKENDS:
        assert verdicts_of_loader(folder, backend) == said, backend
    run_tool("make_shards", "index", folder, "--on-error", "skip", "--quiet", check=True)
    assert verdicts_of_verify(folder) == said  # index hides nothing
    indexed = verdicts_of_dataset(folder)
    assert indexed == {k: v for k, v in said.items() if k in indexed}


@pytest.mark.backend
def test_verify_the_loaders_and_shard_dataset_agree_on_odd_shards(tmp_path):
    odd_folder(tmp_path / "odd", range(40))
    check_agreement(tmp_path / "odd")


@pytest.mark.slow
def test_they_agree_over_300_seeds(tmp_path):
    odd_folder(tmp_path / "odd", range(40, 340))
    check_agreement(tmp_path / "odd")
