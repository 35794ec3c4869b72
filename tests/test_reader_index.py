"""The index reader (pipeline/loading/reader_index.py): local indexed shards read through their
.idx offsets with numpy, no DALI. Every sample once an epoch, in a window-shuffled order drawn
from the seed; ranks disjoint; exact resume; the same samples and bytes as DALI's reader, on
images (labels, extras) as on text; chosen automatically for stored token ids only; shards
changed after indexing refused or re-read."""

from __future__ import annotations

import io
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import dali_available, http_server, jpeg_bytes, resumed_run

from shardflow import image_loader, text_loader
from shardflow.builtin import make_text_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.convert.sources import TextOptions
from shardflow.errors import DataError
from shardflow.loading import reader_index
from shardflow.loading.readplan import plan_epoch
from shardflow.loading.shardlist import resolve_source
from shardflow.shards.daliindex import parse_index

DALI = pytest.mark.skipif(not dali_available(), reason="DALI is not installed")


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A shard written with tarfile, its .idx made by our indexer (make_shards index)."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """Five shards of 13 samples (65): JPEG, .cls, .json, and one sample without .json."""
    from conftest import run_tool

    root = tmp_path_factory.mktemp("ireader")
    raw = root / "raw"
    raw.mkdir()
    for s in range(5):
        members = []
        for i in range(13):
            key = f"s{s}k{i:02d}"
            members += [(f"{key}.jpg", jpeg_bytes(s * 100 + i, (24, 20))),
                        (f"{key}.cls", str((s + i) % 4).encode())]
            if (s, i) != (2, 5):
                members.append((f"{key}.json", json.dumps({"n": s * 100 + i}).encode()))
        _tar(raw / f"part-{s}.tar", members)
    run_tool("make_shards", "index", raw, check=True)
    return raw


def _plan(source, epoch=0, rank=0, world_size=1, shuffle_buffer=16, batch_size=5):
    return plan_epoch(resolve_source(source), epoch=epoch, seed=3, rank=rank,
                      world_size=world_size, shuffle=shuffle_buffer > 1, batch_size=batch_size,
                      shuffle_buffer=shuffle_buffer)


def _read(source, **kw) -> list:
    plan = _plan(source, **kw)
    return list(reader_index.batches(plan, None, ("jpg",), ("json",)))


def _keys(batches) -> list[str]:
    return [k for b in batches for k in b.keys]


def _shard_order(source, epoch=0, shuffle_buffer=16) -> list[str]:
    """Keys in the plan's shard order, each shard's samples as its index lists them."""
    plan = _plan(source, epoch=epoch, shuffle_buffer=shuffle_buffer)
    keys = []
    for shard in plan.shards:
        with open(shard.index_url) as f:
            keys += [s[0][3].split(".")[0] for s in parse_index(f.read())]
    return keys


def test_every_sample_once_an_epoch_in_windows_drawn_from_the_seed(labelled):
    epochs = [_keys(_read(labelled, epoch=e)) for e in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) and len(e) == 65 for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # another order every epoch
    assert _keys(_read(labelled, epoch=1)) == epochs[1]  # and the same one again
    # A sample stays within its window of 16 of the shards' order: the window shuffle.
    for e, keys in enumerate(epochs):
        plain = _shard_order(labelled, e)
        for window in range(0, 65, 16):
            assert sorted(keys[window: window + 16]) == sorted(plain[window: window + 16])
        assert keys != plain
    # shuffle_buffer 0: the shards' own order, whole
    assert _keys(_read(labelled, shuffle_buffer=0)) == _shard_order(labelled, shuffle_buffer=0)


def test_bytes_labels_and_extras_are_the_shards(labelled):
    want = {}
    for shard in sorted(labelled.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar:
                key, ext = m.name.split(".", 1)
                want.setdefault(key, {})[ext] = tar.extractfile(m).read()  # type: ignore[union-attr]
    batches = _read(labelled)
    assert [len(b) for b in batches] == [5] * 13
    for b in batches:
        assert b.urls == [u for u in b.urls if u.endswith(".tar")]
        buffer, sizes = b.flat
        assert bytes(buffer) == b"".join(want[k]["jpg"] for k in b.keys)
        assert sizes.tolist() == [len(want[k]["jpg"]) for k in b.keys]
        for k, data, label, extra, url in zip(b.keys, b.data, b.labels, b.extras["json"],
                                              b.urls, strict=True):
            assert data.tobytes() == want[k]["jpg"] and label == want[k]["cls"]
            assert extra == want[k].get("json")  # None for the sample without one
            assert Path(url).name == f"part-{k[1]}.tar"


def test_ranks_read_disjoint_shards_of_an_even_length(labelled):
    ranks = [_keys(_read(labelled, rank=r, world_size=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 26  # 3 shards and 2: the smaller rank's count
    assert not set(ranks[0]) & set(ranks[1])
    assert {k[:2] for k in ranks[0]}.isdisjoint({k[:2] for k in ranks[1]})


def test_resume_from_any_read_continues_exactly(labelled):
    plan = _plan(labelled)
    whole = list(reader_index.batches(plan, None, ("jpg",)))
    for n in range(len(whole)):
        rest = list(reader_index.batches(plan, whole[n].state, ("jpg",)))
        assert _keys(rest) == _keys(whole[n + 1:]), n


@DALI
def test_the_same_samples_as_dalis_reader_on_the_image_loader(labelled):
    common = {"batch_size": 8, "size": 20, "device": "cpu", "seed": 1, "extras": ("json",),
              "shuffle_buffer": 16, "on_error": "skip"}

    def samples(reader: str) -> tuple[dict, list]:
        found = {}
        with image_loader(labelled, reader=reader, **common) as loader:
            for b in loader:
                for i, k in enumerate(b.keys):
                    found[k] = (b.image[i].clone(), int(b.label[i]), b.extras["json"][i])
            return found, [(s["key"], s["reason"]) for s in loader.skipped]

    (mine, my_skips), (dalis, dali_skips) = samples("index"), samples("dali")
    # the sample without the .json asked for is skipped by both, and named
    assert my_skips == dali_skips == [("s2k05", "missing-field")]
    assert len(mine) == 64 and mine.keys() == dalis.keys()
    for k, (image, label, extra) in mine.items():
        assert torch.equal(image, dalis[k][0]) and label == dalis[k][1]
        assert extra == dalis[k][2]


@pytest.mark.parametrize("backend", [
    pytest.param("dali", marks=DALI), "portable"])
@pytest.mark.backend
def test_image_loader_resumes_exactly_on_either_backend(labelled, backend):
    def make():
        return image_loader(labelled, batch_size=6, size=20, device="cpu", reader="index",
                            backend=backend, shuffle_buffer=16)

    head, rest, again = resumed_run(make, after=4)
    assert [b.keys for b in again] == [b.keys for b in rest] and len(rest) == 7
    assert all(torch.equal(a.image, b.image) for a, b in zip(again, rest, strict=True))


def _ids(tmp_path: Path, docs: int = 60) -> Path:
    texts = make_text_corpus(tmp_path / "docs", docs=docs)
    out = tmp_path / "ids"
    convert(ConvertConfig(kind="text", src=str(texts), out=out, max_count=20, workers=1,
                          text=TextOptions(tokenizer="bytes")))
    return out


@pytest.mark.backend
def test_auto_picks_it_for_stored_ids_only(tmp_path, caplog):
    ids = _ids(tmp_path)
    with caplog.at_level(logging.INFO, logger="shardflow.loading.readers"):
        with text_loader(ids, batch_size=4, seq_len=32, device="cpu") as loader:
            assert loader.reader == "index"
            assert sum(len(b.keys) for b in loader) > 0
    assert "index reader for" in caplog.text
    # a tuning file's reader is for images: stored ids keep the index reader
    from shardflow.loading.tuning import Tuning

    tuning = tmp_path / "tuning.json"
    Tuning(device="cpu", reader="dali", threads=2, prefetch=2, images_per_s=1.0).save(tuning)
    with text_loader(ids, batch_size=4, seq_len=32, device="cpu", tuning_file=tuning) as loader:
        assert loader.reader == "index"
    text = tmp_path / "text"
    convert(ConvertConfig(kind="text", src=str(tmp_path / "docs"), out=text, max_count=20,
                          workers=1))
    with text_loader(text, batch_size=4, seq_len=32, device="cpu") as loader:
        assert loader.reader == ("dali" if dali_available() else "stream")


def test_remote_or_unindexed_shards_are_refused_naming_the_fix(tmp_path):
    ids = _ids(tmp_path)
    with http_server(ids) as url:
        with pytest.raises(ValueError, match="reader='index' needs local .tar shards with "
                           ".idx.*use reader='stream'"):
            text_loader(f"{url}/manifest.json", batch_size=4, reader="index", device="cpu")
        # auto: stored ids on remote shards are streamed
        with text_loader(f"{url}/manifest.json", batch_size=4, device="cpu") as loader:
            assert loader.reader == "stream"
    for idx in ids.glob("*.idx"):
        idx.unlink()
    with pytest.raises(ValueError, match="reader='index' needs local .tar shards with .idx"):
        text_loader(ids, batch_size=4, reader="index", device="cpu")


def test_a_shard_cut_short_after_indexing_is_refused_up_front(tmp_path):
    ids = _ids(tmp_path)
    shard = sorted(ids.glob("*.tar"))[1]
    shard.write_bytes(shard.read_bytes()[:3000])
    with pytest.raises(DataError, match=f"truncated.*{shard.name}|{shard.name}.*truncated"):
        text_loader(ids, batch_size=4, reader="index", device="cpu")
    with text_loader(ids, batch_size=4, reader="index", device="cpu", on_error="skip") as ld:
        keys = {k for b in ld for k in b.keys}
        assert len(keys) == 40 and ld.skipped[0]["reason"] == "truncated"


def test_a_shard_rewritten_in_place_is_read_afresh(tmp_path):
    """Tables and maps are cached by the files' identity, so new bytes under the same names
    are read, not the old offsets."""
    ids = _ids(tmp_path)
    with text_loader(ids, batch_size=4, seq_len=32, reader="index", device="cpu",
                     train=False) as loader:
        before = [b.input_ids.clone() for b in loader]
    texts = make_text_corpus(tmp_path / "other", docs=60, seed=9)
    convert(ConvertConfig(kind="text", src=str(texts), out=ids, max_count=20, workers=1,
                          overwrite=True, text=TextOptions(tokenizer="bytes")))
    with text_loader(ids, batch_size=4, seq_len=32, reader="index", device="cpu",
                     train=False) as loader:
        after = torch.cat([b.input_ids[b.attention_mask == 1] for b in loader])
    # in order (train=False), the bytes tokenizer's ids are the new documents' bytes
    got = after[after < 256].numpy().astype(np.uint8).tobytes()
    assert got == b"".join(p.read_bytes() for p in sorted(texts.iterdir()))
    assert not torch.equal(torch.cat([b.flatten() for b in before]), after)


@pytest.mark.backend
def test_a_sample_without_its_member_reads_empty_and_the_loader_counts_it(tmp_path):
    from conftest import run_tool

    raw = tmp_path / "raw"
    raw.mkdir()
    members = [(f"k{i}.jpg", jpeg_bytes(i, (24, 20))) for i in range(6)]
    members[2:3] = [("k2.png.txt", b"not an image member"), ("k2.cls", b"1")]
    _tar(raw / "only.tar", members)
    run_tool("make_shards", "index", raw, check=True)
    plan = _plan(raw, shuffle_buffer=0, batch_size=6)
    (batch,) = reader_index.batches(plan, None, ("jpg",))
    assert batch.keys == ["k0", "k1", "k2", "k3", "k4", "k5"]
    assert len(batch.data[2]) == 0 and batch.flat[1].tolist()[2] == 0
    assert batch.labels[2] == b"1" and batch.labels[0] is None
    with image_loader(raw, batch_size=6, size=20, device="cpu", reader="index",
                      backend="portable", labels=False, on_error="skip") as loader:
        assert sum(len(b) for b in loader) == 5
        assert [(s["key"], s["reason"]) for s in loader.skipped] == [("k2", "missing-field")]


def test_a_holdout_split_of_stored_ids_takes_the_same_documents_on_every_reader(tmp_path):
    """The stored-ids loader takes a read's buffer whole (no view a document); dropping the
    held-out documents unpacks it first."""
    from shardflow.loading.holdout import KeyHoldout

    ids = _ids(tmp_path)

    def documents(reader: str, side: str) -> list[str]:
        with text_loader(ids, batch_size=4, seq_len=32, reader=reader, device="cpu",
                         train=False) as loader:
            loader.holdout = KeyHoldout(side, 4)
            return [k for b in loader for k in b.keys]

    train, held = documents("index", "train"), documents("index", "eval")
    assert train and held and not set(train) & set(held)
    assert len(set(train) | set(held)) == 60
    assert documents("stream", "train") == train and documents("stream", "eval") == held


def _open_shard_files(folder: Path) -> int:
    """This process's open files among `folder`'s shards (maps hold their own descriptor)."""
    import os

    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        found += target.startswith(str(folder)) and target.endswith(".tar")
    return found


def test_a_pass_lets_go_of_the_shards_it_is_past(tmp_path, monkeypatch):
    """Only the shards of the current read stay mapped (and the few the cache keeps), not
    every shard of the pass: a rank with thousands of shards must not run out of files."""
    texts = make_text_corpus(tmp_path / "docs", docs=80)
    ids = tmp_path / "ids"
    convert(ConvertConfig(kind="text", src=str(texts), out=ids, max_count=2, workers=1,
                          text=TextOptions(tokenizer="bytes")))
    monkeypatch.setattr(reader_index, "_MAPPED", reader_index._Mapped(3))
    plan = plan_epoch(resolve_source(ids), epoch=0, seed=-1, rank=0, world_size=1,
                      shuffle=True, batch_size=4, shuffle_buffer=8)  # a negative seed too
    most, keys = 0, []
    for batch in reader_index.batches(plan, None, ("tokens.u16",)):
        keys += batch.keys
        most = max(most, _open_shard_files(ids))
    assert sorted(keys) == sorted(p.stem for p in texts.iterdir()) and len(plan.shards) == 40
    assert most <= 3 + 8  # the cache's 3, and at most a window's shards


def test_a_shard_cut_after_the_loader_was_built_is_named_not_misread(tmp_path):
    ids = _ids(tmp_path)
    with text_loader(ids, batch_size=4, seq_len=32, reader="index", device="cpu") as loader:
        shard = sorted(ids.glob("*.tar"))[2]
        shard.write_bytes(shard.read_bytes()[:2048])
        with pytest.raises(DataError, match=f"truncated.*{shard.name}|{shard.name}.*truncated"):
            list(loader)
