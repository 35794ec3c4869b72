"""Shards made by other tools are read as webdataset reads them (shared/BAD_INPUTS.md, "odd
but valid"): GNU tar's folder entries and `./` prefixes, webdataset's own writers, gzip
shards and `.gz` members. What such shards get wrong is named: keys with dots, a compression
bomb, the wrong loader for the data. Every tar is built here (Python's tarfile, GNU tar,
webdataset) and read by the real loaders on the CPU and the real tools.
"""

from __future__ import annotations

import gzip
import io
import subprocess
import tarfile
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
from badfiles import special, tar_bytes
from conftest import jpeg_bytes, load_manifest, make_image_folder, run_tool, shard_paths

from shardflow import image_loader, text_loader
from shardflow.errors import DataError, SkipLog
from shardflow.shards.tarread import TarLimits, iter_samples
from shardflow.shards.writer import ShardWriter

# A dependency, but absent where nothing installs (the lent GPU machine's own Python):
# this file then skips instead of stopping `pytest -m gpu` at collection.
wds = pytest.importorskip("webdataset")

DOCS = {f"doc{i}": f"document number {i}\n".encode() for i in range(5)}


def text_tree(root: Path) -> Path:
    """ROOT/train/docN.txt: the folder GNU tar is pointed at."""
    (root / "train").mkdir(parents=True)
    for key, text in DOCS.items():
        (root / "train" / f"{key}.txt").write_bytes(text)
    return root


def gnu_tar(out: Path, src: Path, *members: str) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = "-czf" if out.name.endswith((".tgz", ".tar.gz")) else "-cf"
    subprocess.run(["tar", flags, str(out), "-C", str(src), *members], check=True)
    return out


def read_texts(source: Any, **kw: Any) -> tuple[dict[str, bytes], list[dict[str, Any]], int]:
    """({key: document}, skip entries, samples skipped) through text_loader's streaming
    reader: one document per row and per batch, its bytes back from the byte tokenizer."""
    docs: dict[str, bytes] = {}
    with text_loader(source, batch_size=1, seq_len=64, packing=False, reader="stream",
                     device="cpu", **kw) as loader:
        for batch in loader:
            if not len(batch):  # a read whose one document was skipped: a batch of 0 rows
                continue
            (key,) = batch.keys
            docs[key] = bytes(int(t) for t in batch.input_ids[0] if t < 256)
        return docs, loader.skipped, loader.skipped_samples()


def wds_keys(url: Path) -> list[str]:
    return [s["__key__"] for s in wds.WebDataset(str(url), shardshuffle=False,
                                                 empty_check=False)]


# -- GNU tar: folder entries, ./ prefixes ------------------------------------------------------

@pytest.mark.parametrize("members, prefix", [(["train"], "train/"), (["."], "./train/")])
def test_gnu_tar_folder_entries_are_passed_over_and_keys_follow_webdataset(tmp_path, members,
                                                                           prefix):
    shard = gnu_tar(tmp_path / "gnu.tar", text_tree(tmp_path / "src"), *members)
    with tarfile.open(shard) as tar:  # the case under test: GNU tar wrote folder entries
        assert any(m.isdir() for m in tar.getmembers())
    docs, skipped, lost = read_texts(str(shard), on_error="skip")
    assert skipped == [] and lost == 0
    assert docs == {prefix + k: text for k, text in DOCS.items()}
    assert sorted(docs) == sorted(wds_keys(shard))


def test_gnu_tar_gzip_shard_converts_and_verifies(tmp_path):
    src = tmp_path / "shards"
    gnu_tar(src / "foreign.tgz", text_tree(tmp_path / "docs"), ".")  # ./, ./train/, gzip
    proc = run_tool("verify_shards", src, "--jobs", 1)
    assert proc.returncode == 0 and "5 samples" in proc.stdout, proc.stdout
    run_tool("make_shards", "shards", src, tmp_path / "out", "--workers", 1, "--quiet",
             check=True)
    manifest = load_manifest(tmp_path / "out")
    assert manifest["total_samples"] == 5 and manifest["skipped"] == []
    proc = run_tool("verify_shards", tmp_path / "out", "--jobs", 1)
    assert proc.returncode == 0, proc.stdout
    docs, _, _ = read_texts(str(tmp_path / "out"))
    assert sorted(docs.values()) == sorted(DOCS.values())


def test_an_unsorted_gnu_tar_reshards_to_every_sample(tmp_path):
    """`tar -cf` of a folder stores files in directory order, so a key's .jpg and .cls lie
    apart (here: every image, then every label). The loaders refuse such keys, naming the
    fix; make_shards shards puts each key back together, and the result reads in full."""
    src = tmp_path / "folder"
    src.mkdir()
    for i in range(4):
        (src / f"img{i}.jpg").write_bytes(jpeg_bytes(i))
        (src / f"img{i}.cls").write_bytes(str(i % 2).encode())
    order = [f"img{i}.jpg" for i in range(4)] + [f"img{i}.cls" for i in range(4)]
    shard = gnu_tar(tmp_path / "shards" / "unsorted.tar", src, *order)
    with pytest.raises(DataError, match=r"apart.*shardflow convert shards. puts .* back together"):
        with image_loader(str(shard), batch_size=2, size=16, device="cpu", reader="stream",
                          backend="portable", use_tuning=False) as loader:
            list(loader)
    run_tool("make_shards", "shards", tmp_path / "shards", tmp_path / "out", "--workers", 1,
             "--quiet", check=True)
    manifest = load_manifest(tmp_path / "out")
    assert manifest["total_samples"] == 4 and manifest["skipped"] == []
    with image_loader(str(tmp_path / "out"), batch_size=2, size=16, device="cpu",
                      reader="stream", backend="portable", use_tuning=False) as loader:
        labels = {k: int(b.label[i]) for b in loader for i, k in enumerate(b.keys)}
    assert labels == {f"img{i}": i % 2 for i in range(4)}


def test_links_devices_fifos_still_refused_and_folders_are_not_skips(tmp_path):
    shard = tmp_path / "mixed.tar"
    folder = special("train/", tarfile.DIRTYPE)
    shard.write_bytes(tar_bytes([
        folder, ("train/a.txt", b"first"), special("train/l.txt", tarfile.SYMTYPE, "/etc/passwd"),
        special("train/d.txt", tarfile.CHRTYPE), special("train/f.txt", tarfile.FIFOTYPE),
        ("train/b.txt", b"second")]))
    docs, skipped, lost = read_texts(str(shard), on_error="skip")
    assert docs == {"train/a": b"first", "train/b": b"second"}
    assert sorted((e["key"], e["reason"]) for e in skipped) == [
        (f"train/{k}", "not-a-regular-file") for k in "dfl"]
    assert len(docs) + lost == 5  # the folder is neither a sample nor a skip
    with pytest.raises(DataError, match=r"mixed.tar key 'train/l'.*\[not-a-regular-file\]"):
        read_texts(str(shard))


# -- webdataset's writers ----------------------------------------------------------------------

def test_webdataset_shard_writer_and_compressed_tar_writer_shards_are_read(tmp_path):
    with wds.ShardWriter(str(tmp_path / "wds-%06d.tar"), maxcount=2, verbose=0) as sink:
        for key, text in DOCS.items():
            sink.write({"__key__": key, "txt": text.decode()})
    with wds.TarWriter(str(tmp_path / "more.tgz"), compress=True) as sink:
        sink.write({"__key__": "zipped", "txt": "in a gzip shard\n"})
    assert len(list(tmp_path.glob("wds-*.tar"))) == 3
    docs, skipped, _ = read_texts(str(tmp_path), on_error="skip")
    assert skipped == [] and docs == {**DOCS, "zipped": b"in a gzip shard\n"}


def test_webdataset_image_shards_read_by_the_image_loader(tmp_path):
    with wds.TarWriter(str(tmp_path / "img-000000.tar")) as sink:
        for i in range(4):
            sink.write({"__key__": f"im{i}", "jpg": jpeg_bytes(i), "cls": i % 2})
    with image_loader(str(tmp_path), batch_size=4, train=False, device="cpu",
                      reader="auto") as loader:
        assert loader.reader == "stream"  # no .idx beside a foreign shard
        (batch,) = list(loader)
    assert sorted(batch.keys) == [f"im{i}" for i in range(4)]
    assert {k: int(v) for k, v in zip(batch.keys, batch.label, strict=True)} == \
        {f"im{i}": i % 2 for i in range(4)}


# -- gzip shards and .gz members ---------------------------------------------------------------

def test_tgz_and_tar_gz_in_a_folder_go_to_the_streaming_reader(tmp_path):
    members = [(f"{k}.txt", t) for k, t in DOCS.items()]
    (tmp_path / "a.tgz").write_bytes(gzip.compress(tar_bytes(members[:2]), mtime=0))
    (tmp_path / "b.tar.gz").write_bytes(gzip.compress(tar_bytes(members[2:]), mtime=0))
    with text_loader(str(tmp_path), batch_size=2, device="cpu") as loader:  # reader="auto"
        assert loader.reader == "stream"
        keys = {k for batch in loader for k in batch.keys}
    assert keys == set(DOCS)


def test_gz_members_are_expanded_and_lose_the_suffix(tmp_path):
    (tmp_path / "t.tar").write_bytes(tar_bytes(
        [("a.txt.gz", gzip.compress(DOCS["doc0"])), ("b.txt", DOCS["doc1"]),
         ("c.txt.gz", gzip.compress(b"two ") + gzip.compress(b"members")),
         ("d.txt.gz", gzip.compress(b"padded") + bytes(512))]))  # zeros after: gzip reads it
    docs, skipped, _ = read_texts(str(tmp_path / "t.tar"), on_error="skip")
    assert skipped == [] and docs == {"a": DOCS["doc0"], "b": DOCS["doc1"], "c": b"two members",
                                      "d": b"padded"}
    (tmp_path / "i.tar").write_bytes(tar_bytes(
        [("p.jpg.gz", gzip.compress(jpeg_bytes(1))), ("p.cls", b"1"),
         ("q.jpg", jpeg_bytes(2)), ("q.cls", b"0")]))
    with image_loader(str(tmp_path / "i.tar"), batch_size=2, train=False,
                      device="cpu") as loader:
        (batch,) = list(loader)
    assert sorted(zip(batch.keys, batch.label.tolist(), strict=True)) == [("p", 1), ("q", 0)]


def _bomb(mib: int) -> bytes:
    """`mib` MiB of zeros, gzipped (about 1 KiB per MiB), built without holding them."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    return b"".join(z.compress(zeros) for _ in range(mib)) + z.flush()


def test_a_gz_member_bomb_is_refused_naming_shard_and_key_without_expanding_it(tmp_path):
    shard = tar_bytes([("ok.txt", b"fine"), ("boom.txt.gz", _bomb(64)),
                       ("bad.txt.gz", b"not gzip"), ("z.txt", b"last")])
    skips = SkipLog(announce=False)
    tracemalloc.start()
    try:
        got = list(iter_samples(io.BytesIO(shard), "bombs.tar", on_error="skip", skips=skips,
                                limits=TarLimits(max_member_bytes=1 << 20)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated for a 1 MiB limit"
    assert [s["__key__"] for s in got] == ["ok", "z"]
    assert [(e["source"], e["key"], e["reason"]) for e in skips.entries] == [
        ("bombs.tar", "boom", "member-too-large"), ("bombs.tar", "bad", "bad-gzip")]
    with pytest.raises(DataError, match=r"bombs.tar key 'boom'.*max_member_bytes=1048576"):
        list(iter_samples(io.BytesIO(shard), "bombs.tar",
                          limits=TarLimits(max_member_bytes=1 << 20)))


# -- keys with dots ----------------------------------------------------------------------------

DOTTED = [("img.0001.txt", b"one"), ("img.0002.txt", b"two"), ("img.0003.txt", b"three"),
          ("b.txt", b"bee"), ("c.txt", b"sea")]


def test_dotted_keys_are_named_and_counted_in_samples(tmp_path):
    (tmp_path / "dots.tar").write_bytes(tar_bytes(DOTTED))
    docs, skipped, lost = read_texts(str(tmp_path / "dots.tar"), on_error="skip")
    assert docs == {"b": b"bee", "c": b"sea"}
    assert len(docs) + lost == len(DOTTED)
    (entry,) = skipped
    assert (entry["key"], entry["reason"], entry["samples"]) == ("img", "dotted-key", 3)
    assert "webdataset" in entry["detail"] and "'img.0001.txt'" in entry["detail"]
    with pytest.raises(DataError, match=r"dots.tar key 'img': 3 samples share this key.*"
                                        r"\[dotted-key\]"):
        read_texts(str(tmp_path / "dots.tar"))


def test_dotted_keys_pass_make_shards_as_one_sample_and_the_loader_names_them(tmp_path):
    (tmp_path / "dots.tar").write_bytes(tar_bytes(DOTTED))
    skips = SkipLog(announce=False)  # grouping keeps `img` whole, as webdataset reads it
    got = list(iter_samples(io.BytesIO(tar_bytes(DOTTED)), "dots.tar", skips=skips))
    assert skips.entries == [] and [s["__key__"] for s in got] == ["img", "b", "c"]
    run_tool("make_shards", "shards", tmp_path / "dots.tar", tmp_path / "out", "--workers", 1,
             "--quiet", check=True)
    manifest = load_manifest(tmp_path / "out")
    assert manifest["total_samples"] == 3 and manifest["skipped"] == []
    docs, skipped, lost = read_texts(str(tmp_path / "out"), on_error="skip")
    assert docs == {"b": b"bee", "c": b"sea"} and len(docs) + lost == len(DOTTED)
    assert [(e["key"], e["reason"], e["samples"]) for e in skipped] == [("img", "dotted-key", 3)]


def test_several_dotted_members_of_one_sample_pass_make_shards_and_verify(tmp_path):
    pairs = {k: {"left.jpg": jpeg_bytes(2 * i), "right.jpg": jpeg_bytes(2 * i + 1),
                 "cls": str(i).encode()} for i, k in enumerate(["k", "m"])}
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "pairs.tar").write_bytes(tar_bytes(
        [(f"{k}.{ext}", data) for k, members in pairs.items() for ext, data in members.items()]))
    proc = run_tool("verify_shards", tmp_path / "src", "--jobs", 1)  # a foreign tar: no .idx
    assert "2 samples" in proc.stdout and "problems by reason: missing-index=1\n" in \
        proc.stdout, proc.stdout + proc.stderr
    run_tool("make_shards", "shards", tmp_path / "src", tmp_path / "out", "--workers", 1,
             "--quiet", check=True)
    manifest = load_manifest(tmp_path / "out")
    assert manifest["total_samples"] == 2 and manifest["skipped"] == []
    proc = run_tool("verify_shards", tmp_path / "out", "--jobs", 1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (shard,) = shard_paths(tmp_path / "out")
    with shard.open("rb") as f:
        got = {str(s["__key__"]): {e: d for e, d in s.items() if not e.startswith("__")}
               for s in iter_samples(f, str(shard))}
    assert got == pairs
    # The image loader needs a .jpg: it finds none, and the dotted ones name the likely cause.
    with pytest.raises(DataError, match=r"skipped: 2 dotted-key; the first, .* key 'k': 2 "
                                        r"samples .*'k.left.jpg', 'k.right.jpg'"):
        with image_loader(str(shard), batch_size=2, train=False, device="cpu",
                          reader="stream", on_error="skip") as loader:
            list(loader)


def test_a_second_dotted_extension_is_webdataset_convention_not_a_dotted_key():
    shard = tar_bytes([("x.jpg", b"a"), ("x.seg.jpg", b"b"), ("y.jpg", b"c"),
                       ("y.seg.jpg", b"d")])
    skips = SkipLog(announce=False)
    got = list(iter_samples(io.BytesIO(shard), "seg.tar", on_error="skip", skips=skips))
    assert skips.entries == [] and [sorted(s) for s in got] == [
        ["__key__", "__url__", "jpg", "seg.jpg"]] * 2


# -- the DALI reader and the loader's build ----------------------------------------------------

def _image_shard(folder: Path, odd: dict[str, dict[str, bytes]]) -> Path:
    """A shardflow shard (with its .idx) of three good images and the `odd` samples."""
    writer = ShardWriter(folder, "img", max_count=100, max_size=1 << 30)
    for i in range(3):
        writer.write({"__key__": f"good{i}", "jpg": jpeg_bytes(i), "cls": b"0"})
    for key, members in odd.items():
        writer.write({"__key__": key, **members})
    info = writer.finish()
    assert info is not None
    return folder / info.name


def test_dali_reader_names_shard_and_key_of_a_sample_with_neither_image_nor_label(tmp_path):
    shard = _image_shard(tmp_path, {"lonely": {"json": b"{}"}})
    with pytest.raises(DataError, match=rf"{shard} key 'lonely': no \.cls member"):
        with image_loader(str(shard), batch_size=2, train=False, device="cpu",
                          reader="dali") as loader:
            list(loader)
    with image_loader(str(shard), batch_size=2, train=False, device="cpu", reader="dali",
                      on_error="skip") as loader:
        keys = {k for batch in loader for k in batch.keys}
        assert [(e["source"], e["key"]) for e in loader.skipped] == [(str(shard), "lonely")]
    assert keys == {"good0", "good1", "good2"}


def test_a_loader_of_another_modality_is_refused_at_build_naming_the_right_one(tmp_path):
    (tmp_path / "docs").mkdir()
    for key, text in DOCS.items():
        (tmp_path / "docs" / f"{key}.txt").write_bytes(text)
    run_tool("make_shards", "text", tmp_path / "docs", tmp_path / "text", "--workers", 1,
             "--quiet", check=True)
    with pytest.raises(ValueError, match=r"these shards hold text \(manifest.json's modality\)"
                                         r".*read them with text_loader"):
        image_loader(str(tmp_path / "text"), batch_size=2, device="cpu")
    make_image_folder(tmp_path / "imgs", classes=2, per_class=2)
    run_tool("make_shards", "imagefolder", tmp_path / "imgs", tmp_path / "images",
             "--workers", 1, "--quiet", check=True)
    with pytest.raises(ValueError, match="hold image .*read them with image_loader"):
        text_loader(str(tmp_path / "images"), batch_size=2, device="cpu")


def test_skips_of_unknown_size_are_counted_apart(tmp_path):
    (tmp_path / "good.tar").write_bytes(tar_bytes([("g.txt", b"good")]))
    cut = tar_bytes([("c0.txt", b"c" * 700), ("c1.txt", b"d" * 700)])
    (tmp_path / "cut.tar").write_bytes(cut[:1800])  # inside c1: the rest's size is unknown
    with text_loader([str(tmp_path / "good.tar"), str(tmp_path / "cut.tar")], batch_size=1,
                     device="cpu", on_error="skip") as loader:
        keys = {k for batch in loader for k in batch.keys}
        assert keys == {"g", "c0"}
        assert loader.skipped_samples() == 0 and loader.skipped_of_unknown_size() == 1
        assert [e["reason"] for e in loader.skipped] == ["truncated"]


# -- the two readers: what is the same for one seed --------------------------------------------

def _epochs(source: Path, reader: str, rank: int, world_size: int, **kw: Any
            ) -> list[list[str]]:
    with image_loader(str(source), batch_size=4, device="cpu", reader=reader, seed=3,
                      rank=rank, world_size=world_size, **kw) as loader:
        return [[k for batch in loader for k in batch.keys] for _ in range(2)]


def test_readers_give_the_same_samples_and_without_a_buffer_the_same_order(tmp_path):
    make_image_folder(tmp_path / "src", classes=3, per_class=6)
    run_tool("make_shards", "imagefolder", tmp_path / "src", tmp_path / "out", "--max-count",
             5, "--workers", 1, "--quiet", check=True)
    for rank in (0, 1):  # no sample shuffling: the same order (shard order from seed, epoch)
        dali = _epochs(tmp_path / "out", "dali", rank, 2, shuffle_buffer=0)
        assert dali == _epochs(tmp_path / "out", "stream", rank, 2, shuffle_buffer=0)
        assert dali[0] != dali[1]  # the shard order is drawn again each epoch
    dali = _epochs(tmp_path / "out", "dali", 0, 1)  # a shuffle buffer: the same samples
    stream = _epochs(tmp_path / "out", "stream", 0, 1)
    assert [sorted(e) for e in dali] == [sorted(e) for e in stream]
    assert all(len(e) == 18 for e in dali)


# -- keys made safe ------------------------------------------------------------------------------

def test_keys_that_are_made_safe_alike_stay_apart_and_only_a_key_written_twice_is_refused(
        tmp_path):
    """Other tools' keys in any script or with punctuation: made safe, `猫` and `狗` would
    both be `sample`, `img(1)` would be `img_1`, which is another sample's key."""
    keys = ["猫", "狗", "café", "cafè", "img(1)", "img_1"]
    (tmp_path / "src").mkdir()
    for shard, part in (("a", keys), ("b", ["img_1"])):  # the last: a key written twice
        with wds.TarWriter(str(tmp_path / "src" / f"{shard}-000000.tar")) as writer:
            for i, key in enumerate(part):
                writer.write({"__key__": key, "jpg": jpeg_bytes(seed=i), "cls": b"%d" % i})
    run_tool("make_shards", "shards", tmp_path / "src", tmp_path / "out", "--workers", 1,
             "--quiet", "--on-error", "skip", check=True)
    manifest = load_manifest(tmp_path / "out")
    assert manifest["total_samples"] == len(keys)
    assert [(e["key"], e["reason"]) for e in manifest["skipped"]] == [("img_1", "duplicate-key")]
    with image_loader(tmp_path / "out", batch_size=8, backend="portable", size=32) as loader:
        read = [k for batch in loader for k in batch.keys]
    assert len(set(read)) == len(keys) and "img_1" in read and "sample" in read
    assert {k.split("-")[0] for k in read} == {"sample", "caf", "img_1"}
    result = run_tool("make_shards", "shards", tmp_path / "src", tmp_path / "again",
                      "--workers", 1, "--quiet")
    assert result.returncode != 0 and "key 'img_1'" in result.stderr and \
        "earlier sample" in result.stderr


def test_a_member_extension_with_whitespace_is_a_named_skip_not_a_failed_run(tmp_path):
    """`p2.final version.jpg`: the key is `p2`, the extension `final version.jpg`, which no
    shard index can hold (its fields are split on whitespace)."""
    members = [("p1.jpg", jpeg_bytes(seed=1)), ("p1.cls", b"1"),
               ("p2.final version.jpg", jpeg_bytes(seed=2)), ("p2.cls", b"0"),
               ("p3.jpg", jpeg_bytes(seed=3)), ("p3.cls", b"2")]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a-000000.tar").write_bytes(tar_bytes(members))
    run_tool("make_shards", "shards", tmp_path / "src", tmp_path / "out", "--workers", 1,
             "--quiet", "--on-error", "skip", check=True)
    manifest = load_manifest(tmp_path / "out")
    assert manifest["total_samples"] == 2
    assert [(e["key"], e["reason"]) for e in manifest["skipped"]] == [("p2", "whitespace-name")]
    assert "'final version.jpg'" in manifest["skipped"][0]["detail"]
    assert run_tool("verify_shards", tmp_path / "out").returncode == 0
    failed = run_tool("make_shards", "shards", tmp_path / "src", tmp_path / "again",
                      "--workers", 1, "--quiet")
    assert failed.returncode != 0 and "key 'p2'" in failed.stderr and \
        "[whitespace-name]" in failed.stderr
