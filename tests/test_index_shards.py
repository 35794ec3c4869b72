"""make_shards index: DALI indexes and a manifest for shards made elsewhere (webdataset's own
ShardWriter, GNU tar), without rewriting them; DALI's reader accepts the indexes, the counts and
checksums are the files', verify_shards passes, a stopped run goes on where it stopped, and a
shard the readers would not read as it is, or not alike through an index (whitespace in a name,
a member twice, a gzipped member), is named and left without an index, as is every other file
of the folder that looks like a shard and is not indexed; with --out DIR the indexes of
read-only or remote (HTTP) shards go to DIR, which the loaders, verify_shards and train.py take
as index=DIR.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from badfiles import tar_bytes
from conftest import RangeHandler, http_server, jpeg_bytes, run_tool

from shardflow import image_loader
from shardflow.errors import DataError
from shardflow.shards import daliindex
from shardflow.shards.indexing import index_shard
from shardflow.shards.tarread import TarLimits

# A dependency, but absent where nothing installs (the lent GPU machine's own Python):
# this file then skips instead of stopping `pytest -m gpu` at collection.
wds = pytest.importorskip("webdataset")


def wds_shards(folder: Path, shards: int = 3, per_shard: int = 5) -> dict[str, int]:
    """Shards written by webdataset's ShardWriter: {key: label}."""
    folder.mkdir(parents=True, exist_ok=True)
    labels = {}
    with wds.ShardWriter(str(folder / "part-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(shards * per_shard):
            key = f"s{i:04d}"
            labels[key] = i % 4
            sink.write({"__key__": key, "jpg": jpeg_bytes(i), "cls": str(i % 4).encode()})
    return labels


def keys_read(folder: Path | str, reader: str, backend: str, **kw: object) -> dict[str, int]:
    with image_loader(str(folder), batch_size=4, size=16, device="cpu", reader=reader,
                      backend=backend, use_tuning=False, threads=1, **kw) as loader:
        return {k: int(b.label[i]) for b in loader for i, k in enumerate(b.keys)}


@pytest.mark.backend
def test_index_gives_dali_indexes_and_a_manifest_of_the_files(tmp_path):
    folder = tmp_path / "wds"
    labels = wds_shards(folder)
    before = {p.name: p.read_bytes() for p in folder.glob("*.tar")}
    run_tool("make_shards", "index", folder, "--quiet", check=True)
    assert {p.name: p.read_bytes() for p in folder.glob("*.tar")} == before  # not rewritten
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["total_samples"] == 15 and manifest["modality"] == "image"
    assert manifest["labels"]["ranges"] == [[0, 3]]
    for shard in manifest["shards"]:
        data = before[shard["name"]]
        assert shard["bytes"] == len(data)
        assert shard["sha256"] == hashlib.sha256(data).hexdigest()
        index = daliindex.parse_index((folder / shard["name"]).with_suffix(".idx").read_text())
        assert len(index) == shard["samples"] == 5
        for members in index:  # each entry points at exactly the member's bytes
            for ext, offset, size, name in members:
                assert name.endswith("." + ext) and size > 0
                assert data[offset - 512: offset - 512 + 100].rstrip(b"\0") == name.encode()
    proc = run_tool("verify_shards", folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert keys_read(folder, "stream", "portable") == labels


@pytest.mark.dali
def test_dalis_reader_reads_the_indexed_shards(tmp_path):
    pytest.importorskip("nvidia.dali")
    folder = tmp_path / "wds"
    labels = wds_shards(folder)
    run_tool("make_shards", "index", folder, "--quiet", check=True)
    assert keys_read(folder, "dali", "dali") == labels


@pytest.mark.parametrize("out", [False, True], ids=["beside", "out"])
def test_a_stopped_index_goes_on_where_it_stopped(tmp_path, out):
    """The first shard is indexed, the second is gzipped: the run stops there, naming it; with
    the shard replaced by its plain tar, a rerun reads only that one."""
    folder = tmp_path / "wds"
    wds_shards(folder, shards=2)
    where = tmp_path / "index" if out else folder
    flags = ("--out", where) if out else ()
    second = folder / "part-000001.tar"
    plain = second.read_bytes()
    second.write_bytes(gzip.compress(plain))
    proc = run_tool("make_shards", "index", folder, *flags, "--quiet")
    assert proc.returncode != 0 and "gzipped tar" in proc.stderr and "part-000001" in proc.stderr
    first_idx = where / "part-000000.idx"
    stamp = first_idx.stat().st_mtime_ns
    assert not (where / "manifest.json").exists() and not (where / "part-000001.idx").exists()
    second.write_bytes(plain)
    run_tool("make_shards", "index", folder, *flags, "--quiet", check=True)
    assert first_idx.stat().st_mtime_ns == stamp  # journalled: not read again
    manifest = json.loads((where / "manifest.json").read_text())
    assert [s["samples"] for s in manifest["shards"]] == [5, 5]
    assert not (where / ".shardflow-index.jsonl").exists()


@pytest.mark.backend
def test_a_shard_the_readers_refuse_is_named_left_without_an_index_and_still_read(tmp_path):
    folder = tmp_path / "wds"
    labels = wds_shards(folder, shards=1)
    apart = folder / "apart.tar"  # a key's members apart: what `tar -cf` of a folder gives
    with wds.TarWriter(str(apart)) as sink:
        sink.write({"__key__": "x1", "jpg": jpeg_bytes(90), "cls": b"0"})
        sink.write({"__key__": "x2", "jpg": jpeg_bytes(91), "cls": b"1"})
        sink.write({"__key__": "x1", "cls": b"0"})
    run_tool("make_shards", "index", folder, "--on-error", "skip", "--quiet", check=True)
    manifest = json.loads((folder / "manifest.json").read_text())
    # The streaming reader reads x1 and x2 and refuses x1's second part, as the loaders do.
    assert [(Path(e["source"]).name, e["key"], e["reason"]) for e in manifest["skipped"]] == [
        ("apart.tar", "x1", "split-key")]
    assert [(s["name"], s["samples"], s.get("unindexed")) for s in manifest["shards"]] == [
        ("apart.tar", 2, "split-key"), ("part-000000.tar", 5, None)]
    assert not apart.with_suffix(".idx").exists()
    assert keys_read(folder, "auto", "auto", on_error="skip") == {**labels, "x1": 0, "x2": 1}
    proc = run_tool("verify_shards", folder)  # names the refused part, counts match
    assert proc.returncode == 1 and "[split-key]" in proc.stdout
    assert "apart.tar [split-key]" in proc.stdout and "sha256-mismatch" not in proc.stdout
    proc = run_tool("make_shards", "index", folder, "--quiet")
    assert proc.returncode != 0 and "have a manifest already" in proc.stderr


# -- shards an index cannot describe as the streaming reader reads them ----------------------

BAD_SHARDS = {  # members in archive order; the key, reason and words make_shards index names
    # a plain `tar -cf` of a camera's folder: DALI's index splits its lines on whitespace
    "spaces": ([("IMG 0001.jpg", jpeg_bytes(80)), ("IMG 0001.cls", b"1"),
                ("IMG_0002.jpg", jpeg_bytes(81)), ("IMG_0002.cls", b"2")],
               "IMG 0001", "whitespace-name", "'IMG 0001.jpg' holds whitespace"),
    # a shard extended with `tar -rf`: the streaming reader refuses the key, DALI takes a copy
    "twice": ([("x1.jpg", jpeg_bytes(82)), ("x1.cls", b"0"), ("x1.cls", b"1"),
               ("x2.jpg", jpeg_bytes(83)), ("x2.cls", b"1")],
              "x1", "duplicate-member", "member x1.cls appears twice"),
    # the streaming reader gunzips it to .cls; an index would point at the packed bytes
    "packed": ([("y1.jpg", jpeg_bytes(84)), ("y1.cls.gz", gzip.compress(b"0")),
                ("y2.jpg", jpeg_bytes(85)), ("y2.cls", b"1")],
               "y1", "compressed-member", "'y1.cls.gz' is gzipped"),
}


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A tar of exactly these members, in this order (Python's tarfile)."""
    path.write_bytes(tar_bytes(members))


def gnu_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    """The same made by GNU tar from files on disk, named in this order."""
    tar = shutil.which("tar")
    if tar is None or "GNU" not in subprocess.run([tar, "--version"], capture_output=True,
                                                  text=True).stdout:
        pytest.skip("GNU tar is not installed")
    files = path.parent.parent / f"{path.stem}-files"
    files.mkdir()
    for name, data in members:
        (files / name).write_bytes(data)
    subprocess.run([tar, "-cf", str(path), "-C", str(files), *(n for n, _ in members)],
                   check=True)


def index_skipping(folder: Path) -> tuple[dict, str]:
    """make_shards index --on-error skip: the manifest and what the command printed."""
    proc = run_tool("make_shards", "index", folder, "--on-error", "skip", "--quiet", check=True)
    return json.loads((folder / "manifest.json").read_text()), proc.stdout


def skipped(manifest: dict) -> list[tuple[str, str, str]]:
    return sorted((Path(e["source"]).name, e["key"], e["reason"]) for e in manifest["skipped"])


def read_alike(folder: Path, labels: dict[str, int]) -> None:
    """verify_shards passes on the indexed folder, and the streaming reader and the index
    reader (through the .idx files) read the same samples: `labels`."""
    proc = run_tool("verify_shards", folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert keys_read(folder, "stream", "portable") == labels
    assert keys_read(folder, "index", "portable") == labels


# What the streaming reader reads of each (the loaders' own verdict), and what it refuses.
STREAMED = {"spaces": ({"IMG 0001": 1, "IMG_0002": 2}, []),
            "twice": ({"x2": 1}, [("x1", "duplicate-member")]),
            "packed": ({"y1": 0, "y2": 1}, [])}


@pytest.mark.parametrize("case, maker", [("spaces", write_tar), ("spaces", gnu_tar),
                                         ("twice", write_tar), ("packed", write_tar)],
                         ids=["spaces-tarfile", "spaces-gnu-tar", "twice", "packed"])
@pytest.mark.backend
def test_a_shard_an_index_cannot_describe_is_named_not_indexed_and_still_read(
        tmp_path, case, maker):
    """Indexed, each of these shards gave an index that verify_shards and the loaders reading
    through it refuse (spaces) or read otherwise than the streaming reader (a member twice, a
    gzipped member): now the shard, key and member are named; under skip it stays in the
    manifest, unindexed, and the loaders stream the folder: read + skipped = the folder."""
    folder = tmp_path / "wds"
    labels = wds_shards(folder, shards=1)
    members, key, reason, words = BAD_SHARDS[case]
    bad = folder / f"{case}.tar"
    maker(bad, members)
    proc = run_tool("make_shards", "index", folder, "--quiet")
    assert proc.returncode != 0
    for part in (str(bad), repr(key), words, f"[{reason}]", "shardflow convert shards"):
        assert part in proc.stderr, proc.stderr
    assert not (folder / "manifest.json").exists() and not bad.with_suffix(".idx").exists()
    manifest, out = index_skipping(folder)
    read, refused = STREAMED[case]
    assert skipped(manifest) == [(bad.name, k, r) for k, r in refused]
    assert {s["name"]: (s["samples"], s.get("unindexed")) for s in manifest["shards"]} == {
        bad.name: (len(read), reason), "part-000000.tar": (5, None)}
    assert not bad.with_suffix(".idx").exists() and "left 1 shards without an index" in out
    proc = run_tool("verify_shards", folder)
    assert (proc.returncode == 0) == (not refused), proc.stdout
    assert f"{bad.name} [{reason}]" in proc.stdout
    with image_loader(str(folder), batch_size=4, size=16, use_tuning=False,
                      on_error="skip") as loader:
        got = {k: int(b.label[i]) for b in loader for i, k in enumerate(b.keys)}
        assert got == {**labels, **read}
        assert [(e["key"], e["reason"]) for e in loader.skipped] == refused


@pytest.mark.parametrize("name, fix", [
    ("IMG 0001.jpg", "`shardflow convert shards` rewrites it with its keys made safe"),
    ("my photos/a.jpg", "`shardflow convert shards` rewrites it with its keys made safe"),
    ("tab\tkey.jpg", "`shardflow convert shards` rewrites it with its keys made safe"),
    ("a.final version.jpg", "rename the file and pack it again"),  # extension `final version.jpg`
])
def test_whitespace_in_a_member_name_is_refused_with_the_fix_that_works(tmp_path, name, fix):
    """make_shards shards makes keys safe (`IMG 0001` -> `IMG_0001`) but keeps extensions: the
    refusal says which applies."""
    shard = tmp_path / "s.tar"
    write_tar(shard, [(name, jpeg_bytes(1))])
    with pytest.raises(DataError) as refused:
        index_shard(str(shard), TarLimits())
    assert refused.value.reason == "whitespace-name" and refused.value.source == str(shard)
    assert repr(name) in refused.value.detail and fix in refused.value.detail


@pytest.mark.parametrize("entry", [("jpg", 512, 3, "IMG 0001.jpg"), ("jpg", 512, 3, "a\tb.jpg"),
                                   ("jpg", 512, 3, "a\nb.jpg"), ("jpg", 512, 3, "a\u2028b.jpg"),
                                   ("final version.jpg", 512, 3, "p.final version.jpg"),
                                   ("", 512, 3, "README")])
def test_format_index_refuses_an_entry_its_lines_cannot_hold(entry):
    """Whatever writes an index (make_shards index, the converter's ShardWriter): an entry that
    would shift the fields of its line is refused, not written for the readers to refuse."""
    with pytest.raises(ValueError, match="cannot hold"):
        daliindex.format_index([[("cls", 0, 1, "k.cls"), entry]])


@pytest.mark.backend
def test_make_shards_shards_rewrites_what_index_refused_as_the_refusals_say(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for case, (members, *_) in BAD_SHARDS.items():
        write_tar(bad / f"{case}.tar", members)
    with wds.TarWriter(str(bad / "zipped.tar.gz"), compress=True) as sink:
        sink.write({"__key__": "z1", "jpg": jpeg_bytes(86), "cls": b"3"})
    out = tmp_path / "out"
    run_tool("make_shards", "shards", bad, out, "--on-error", "skip", "--quiet", check=True)
    names = [n for p in out.glob("*.tar") for n in tarfile.open(p).getnames()]
    assert not any(daliindex.has_whitespace(n) or n.endswith(".gz") for n in names)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(e["key"], e["reason"]) for e in manifest["skipped"]] == [("x1", "split-key")]
    read_alike(out, {"IMG_0001": 1, "IMG_0002": 2, "x1": 0, "x2": 1, "y1": 0, "y2": 1,
                     "z1": 3})  # x1: its first copy


@pytest.mark.backend
def test_index_names_every_file_of_the_folder_it_leaves_out(tmp_path):
    """Gzipped shards (.tar.gz, .tgz), which the loaders read, were left out without a word,
    and the manifest written then hid their samples from the loaders; a .TAR, which no loader
    lists, and a FIFO named .tar are named too (the FIFO never opened: it would block)."""
    folder = tmp_path / "wds"
    labels = wds_shards(folder, shards=1)
    for name, key in (("more-000001.tar.gz", "g1"), ("more-000002.tgz", "g2")):
        with wds.TarWriter(str(folder / name), compress=True) as sink:
            sink.write({"__key__": key, "jpg": jpeg_bytes(87), "cls": b"1"})
    assert keys_read(folder, "stream", "portable") == {**labels, "g1": 1, "g2": 1}
    with wds.TarWriter(str(folder / "LOUD-000003.TAR")) as sink:
        sink.write({"__key__": "u1", "jpg": jpeg_bytes(88), "cls": b"1"})
    os.mkfifo(folder / "pipe.tar")
    proc = run_tool("make_shards", "index", folder, "--quiet")
    assert proc.returncode != 0 and "LOUD-000003.TAR" in proc.stderr
    assert "rename it to LOUD-000003.tar" in proc.stderr
    manifest, out = index_skipping(folder)
    assert {Path(e["source"]).name: e["reason"] for e in manifest["skipped"]} == {
        "LOUD-000003.TAR": "unlisted-shard", "pipe.tar": "not-a-regular-file"}
    assert {s["name"]: s.get("unindexed") for s in manifest["shards"]} == {
        "part-000000.tar": None, "more-000001.tar.gz": "compressed-shard",
        "more-000002.tgz": "compressed-shard"}
    assert "left 2 shards without an index" in out
    proc = run_tool("verify_shards", folder)  # what the loaders would not read, named
    assert proc.returncode == 1 and "rename it to LOUD-000003.tar [unlisted-shard]" in proc.stdout
    assert "pipe.tar: manifest.json does not list it" in proc.stdout
    os.remove(folder / "pipe.tar")
    # Nothing hidden: the gzipped shards are read as before.
    assert keys_read(folder, "auto", "auto") == {**labels, "g1": 1, "g2": 1}


@pytest.mark.dali
def test_dalis_reader_refuses_a_folder_index_left_partly_unindexed_naming_the_shards(tmp_path):
    pytest.importorskip("nvidia.dali")
    folder = tmp_path / "wds"
    labels = wds_shards(folder, shards=2)
    for case, (members, *_) in BAD_SHARDS.items():
        write_tar(folder / f"{case}.tar", members)
    manifest, _ = index_skipping(folder)
    assert sorted(s["unindexed"] for s in manifest["shards"] if "unindexed" in s) == [
        "compressed-member", "duplicate-member", "whitespace-name"]
    with pytest.raises(ValueError, match="packed.tar, spaces.tar, twice.tar"):
        keys_read(folder, "dali", "dali")
    read = keys_read(folder, "auto", "dali", on_error="skip")  # streamed
    assert read == {**labels, **{k: v for r, _ in STREAMED.values() for k, v in r.items()}}


# -- --out DIR: indexes for shards that cannot have them beside (read-only, remote) ----------

def in_place_indexes(folder: Path, tmp_path: Path) -> dict[str, str]:
    """The .idx files `make_shards index` writes beside a copy of `folder`'s shards."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in folder.glob("*.tar"):
        (copy / p.name).write_bytes(p.read_bytes())
    run_tool("make_shards", "index", copy, "--quiet", check=True)
    return {p.name: p.read_text() for p in copy.glob("*.idx")}


@pytest.mark.backend
def test_index_out_leaves_the_folder_as_it_is_and_the_loaders_read_through_it(tmp_path):
    folder = tmp_path / "wds"
    labels = wds_shards(folder, shards=4)  # 2 shards a rank: none left out to even them
    before = sorted(folder.iterdir())
    out = tmp_path / "index"
    run_tool("make_shards", "index", folder, "--out", out, "--quiet", check=True)
    assert sorted(folder.iterdir()) == before  # nothing written beside the shards
    assert {p.name: p.read_text() for p in out.glob("*.idx")} == \
        in_place_indexes(folder, tmp_path)
    assert keys_read(folder, "stream", "portable", index=str(out)) == labels
    halves = [keys_read(folder, "stream", "portable", index=str(out), rank=r, world_size=2)
              for r in (0, 1)]  # counts from DIR's manifest: ranks can be split
    assert not halves[0].keys() & halves[1].keys() and {**halves[0], **halves[1]} == labels
    proc = run_tool("verify_shards", folder, "--index", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # A stale index in DIR is found: another shard's index under this one's name.
    (out / "part-000000.idx").write_text((out / "part-000001.idx").read_text())
    proc = run_tool("verify_shards", folder, "--index", out)
    assert proc.returncode == 1 and "bad-index" in proc.stdout


@pytest.mark.dali
def test_dalis_reader_reads_local_shards_through_an_index_folder(tmp_path):
    pytest.importorskip("nvidia.dali")
    folder = tmp_path / "wds"
    labels = wds_shards(folder)
    out = tmp_path / "index"
    run_tool("make_shards", "index", folder, "--out", out, "--quiet", check=True)
    with pytest.raises(ValueError, match="index=DIR"):  # no .idx beside them
        keys_read(folder, "dali", "dali")
    assert keys_read(folder, "dali", "dali", index=str(out)) == labels


@pytest.mark.backend
def test_index_out_over_http_gives_the_files_indexes_and_a_resume_by_range(tmp_path):
    folder = tmp_path / "wds"
    labels = wds_shards(folder, shards=4, per_shard=6)
    out = tmp_path / "index"
    with http_server(folder, RangeHandler) as base:
        pattern = f"{base}/part-{{000000..000003}}.tar"
        proc = run_tool("make_shards", "index", base + "/part-000000.tar", "--quiet")
        assert proc.returncode != 0 and "give --out DIR" in proc.stderr
        run_tool("make_shards", "index", pattern, "--out", out, "--quiet", check=True)
        manifest = json.loads((out / "manifest.json").read_text())
        for shard in manifest["shards"]:
            data = (folder / shard["name"]).read_bytes()
            assert (shard["samples"], shard["bytes"]) == (6, len(data))
            assert shard["sha256"] == hashlib.sha256(data).hexdigest()
        assert manifest["args"]["src"] == pattern and manifest["total_samples"] == 24
        assert {p.name: p.read_text() for p in out.glob("*.idx")} == \
            in_place_indexes(folder, tmp_path)
        # The folder's URL (the manifest names its shards) or the pattern: the same samples.
        assert keys_read(base, "stream", "portable", index=str(out)) == labels
        assert keys_read(pattern, "auto", "auto", index=str(out)) == labels
        proc = run_tool("verify_shards", base, "--index", out)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        fetched, state = _resume_over(base, out)
    # The resume fetched the shuffle buffer's samples by range through DIR's .idx files,
    # not their whole shards.
    stragglers = state["ranks"][0]["reader_state"]["stragglers"]
    assert stragglers
    size = max(p.stat().st_size for p in folder.glob("*.tar"))
    assert fetched < (4 - state["ranks"][0]["reader_state"]["needed"]) * size + \
        len(stragglers) * 4096


def _resume_over(base: str, out: Path) -> tuple[int, dict]:
    def make():  # type: ignore[no-untyped-def]
        return image_loader(base, index=str(out), batch_size=4, size=16, device="cpu",
                            reader="stream", backend="portable", use_tuning=False, threads=1,
                            shuffle_buffer=8, shards_in_flight=2, seed=5)

    with make() as whole:
        everything = list(whole)
    with make() as first:
        it = iter(first)
        for _ in range(3):
            next(it)
        it.close()
        state = json.loads(json.dumps(first.state_dict()))
    with make() as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed)
        fetched = resumed.fetch_stats.remote_bytes
    assert [b.keys for b in rest] == [b.keys for b in everything[3:]]
    for a, b in zip(rest, everything[3:], strict=True):
        assert torch.equal(a.image, b.image)
    return fetched, state


@pytest.mark.backend
def test_an_index_folder_must_name_the_shards_it_is_given(tmp_path):
    folder = tmp_path / "wds"
    wds_shards(folder)
    out = tmp_path / "index"
    with pytest.raises(FileNotFoundError, match="shardflow index SRC --out DIR"):
        keys_read(folder, "stream", "portable", index=str(out))
    run_tool("make_shards", "index", folder / "part-00000[01].tar", "--out", out, "--quiet",
             check=True)
    assert len(keys_read(folder / "part-000001.tar", "stream", "portable", index=str(out))) == 5
    with pytest.raises(ValueError, match="does not name .*part-000002.tar"):
        keys_read(folder / "part-*.tar", "stream", "portable", index=str(out))


@pytest.mark.backend
def test_train_py_trains_on_remote_shards_through_an_index_folder(tmp_path):
    """webdataset-written shards over HTTP, no manifest there: the class count comes from the
    index folder's label statistics, and every 10th shard (here the last) is held out."""
    folder = tmp_path / "wds"
    wds_shards(folder, shards=4, per_shard=6)
    out, run = tmp_path / "index", tmp_path / "run"
    with http_server(folder, RangeHandler) as base:
        run_tool("make_shards", "index", f"{base}/part-{{000000..000003}}.tar", "--out", out,
                 "--quiet", check=True)
        proc = run_tool("train", "--task", "image", "--data", base, "--index", out, "--out",
                        run, "--steps", 2, "--batch-size", 4, "--size", 16, "--device", "cpu",
                        "--precision", "fp32", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and "part-000003.tar" in summary["held_out"]
