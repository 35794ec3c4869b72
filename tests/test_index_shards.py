"""make_shards index: DALI indexes and a manifest for shards made elsewhere (webdataset's own
ShardWriter, GNU tar), without rewriting them; DALI's reader accepts the indexes, the counts and
checksums are the files', verify_shards passes, a stopped run goes on where it stopped, and a
shard the readers would not read as it is is named and left without an index.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest
import webdataset as wds
from conftest import jpeg_bytes, run_tool

from pipeline import image_loader
from pipeline.shards import daliindex


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


def keys_read(folder: Path, reader: str, backend: str) -> dict[str, int]:
    with image_loader(str(folder), batch_size=4, size=16, device="cpu", reader=reader,
                      backend=backend, use_tuning=False, threads=1) as loader:
        return {k: int(b.label[i]) for b in loader for i, k in enumerate(b.keys)}


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


def test_a_stopped_index_goes_on_where_it_stopped(tmp_path):
    """The first shard is indexed, the second is gzipped: the run stops there, naming it; with
    the shard replaced by its plain tar, a rerun reads only that one."""
    folder = tmp_path / "wds"
    wds_shards(folder, shards=2)
    second = folder / "part-000001.tar"
    plain = second.read_bytes()
    second.write_bytes(gzip.compress(plain))
    proc = run_tool("make_shards", "index", folder, "--quiet")
    assert proc.returncode != 0 and "gzipped tar" in proc.stderr and "part-000001" in proc.stderr
    first_idx = folder / "part-000000.idx"
    stamp = first_idx.stat().st_mtime_ns
    assert not (folder / "manifest.json").exists() and not second.with_suffix(".idx").exists()
    second.write_bytes(plain)
    run_tool("make_shards", "index", folder, "--quiet", check=True)
    assert first_idx.stat().st_mtime_ns == stamp  # journalled: not read again
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [s["samples"] for s in manifest["shards"]] == [5, 5]
    assert not (folder / ".shardflow-index.jsonl").exists()


def test_a_shard_the_readers_refuse_is_named_and_left_without_an_index(tmp_path):
    folder = tmp_path / "wds"
    labels = wds_shards(folder, shards=1)
    apart = folder / "apart.tar"  # a key's members apart: what `tar -cf` of a folder gives
    with wds.TarWriter(str(apart)) as sink:
        sink.write({"__key__": "x1", "jpg": jpeg_bytes(90)})
        sink.write({"__key__": "x2", "jpg": jpeg_bytes(91), "cls": b"1"})
        sink.write({"__key__": "x1", "cls": b"0"})
    run_tool("make_shards", "index", folder, "--on-error", "skip", "--quiet", check=True)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [(Path(e["source"]).name, e["key"], e["reason"]) for e in manifest["skipped"]] == [
        ("apart.tar", "x1", "split-key")]
    assert [s["name"] for s in manifest["shards"]] == ["part-000000.tar"]
    assert not apart.with_suffix(".idx").exists()
    assert keys_read(folder, "stream", "portable") == labels  # the manifest's shards
    proc = run_tool("make_shards", "index", folder, "--quiet")
    assert proc.returncode != 0 and "have a manifest already" in proc.stderr
