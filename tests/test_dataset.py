"""ShardDataset (pipeline/access/dataset.py): random access by global index and key, the same
decoded sample as the loader gives for that key, on local and HTTP shards (S3: test_s3.py);
under a DataLoader with 2 workers and a RandomSampler every index read once; raw members are
the tar's bytes; an unknown key, an index out of range and a bad sample are clear errors."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import QuietHandler, RangeHandler, deadline, http_server, jpeg_bytes, run_tool
from PIL import Image, ImageOps

from pipeline import ShardDataset, collate_skipping, image_loader, text_loader
from pipeline.builtin import make_image_folder, make_pointcloud_folder, make_text_corpus
from pipeline.convert import ConvertConfig, convert
from pipeline.convert.sources import TextOptions
from pipeline.errors import DataError


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """30 built-in images (square, 40 px) in 10 classes, 7 a shard, one with an EXIF turn."""
    root = tmp_path_factory.mktemp("dataset")
    src = make_image_folder(root / "src", per_class=3, size=40)
    turned = sorted(src.rglob("*.jpg"))[4]
    img = Image.open(turned)
    exif = img.getexif()
    exif[0x0112] = 6  # stored on its side: upright is a quarter turn away
    img.save(turned, exif=exif.tobytes(), quality=95)
    convert(ConvertConfig(kind="imagefolder", src=str(src), out=root / "out", max_count=7,
                          workers=1))
    return root / "out"


def _tar_members(folder: Path) -> dict[str, dict[str, bytes]]:
    found: dict[str, dict[str, bytes]] = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar:
                key, ext = m.name.split(".", 1)
                found.setdefault(key, {})[ext] = tar.extractfile(m).read()  # type: ignore[union-attr]
    return found


def test_index_and_key_agree_and_raw_members_are_the_tar_bytes(images):
    ds = ShardDataset(images, decode=False)
    members = _tar_members(images)
    assert len(ds) == 30 and ds.keys() == list(members)  # manifest order: shards, then index
    for i, key in enumerate(ds.keys()):
        assert ds.key(i) == key and ds.index_of(key) == i
        sample = ds[i]
        assert {k: v for k, v in sample.items() if not k.startswith("__")} == members[key]
        assert sample["__key__"] == key and sample["__url__"].endswith(".tar")
    assert ds[-1]["__key__"] == ds.key(29)


def test_decoded_images_are_upright_and_the_loaders_pixels(images):
    ds = ShardDataset(images)
    members = _tar_members(images)
    with image_loader(images, batch_size=8, size=40, train=False, crop_fraction=1.0,
                      device="cpu", backend="portable") as loader:
        loaded = {k: (b.image[i], int(b.label[i])) for b in loader for i, k in enumerate(b.keys)}
    assert loaded.keys() == set(ds.keys())
    turned = 0
    for key, (image, label) in loaded.items():
        sample = ds.get(key)
        assert sample["image"].dtype == np.uint8 and sample["image"].shape == (40, 40, 3)
        assert torch.equal(torch.from_numpy(sample["image"]).permute(2, 0, 1), image), key
        assert sample["label"] == label == int(members[key]["cls"])
        stored = Image.open(io.BytesIO(next(v for e, v in members[key].items() if e != "cls")))
        upright = np.asarray(ImageOps.exif_transpose(stored).convert("RGB"))
        assert np.array_equal(sample["image"], upright)
        turned += stored.getexif().get(0x0112, 1) != 1
    assert turned == 1


@pytest.mark.parametrize("ranges", [True, False])
def test_http_shards_read_by_range_requests_give_the_local_samples(images, ranges, caplog):
    local = ShardDataset(images)
    with http_server(images, RangeHandler if ranges else QuietHandler) as url:
        remote = ShardDataset(f"{url}/manifest.json")
        assert len(remote) == len(local) and remote.keys() == local.keys()
        for i in (0, 13, 29):
            a, b = remote[i], local[i]
            assert a["__key__"] == b["__key__"] and a["label"] == b["label"]
            assert np.array_equal(a["image"], b["image"])
    # a server that ignores Range sends whole shards: still right, and said once
    assert caplog.text.count("does not answer range requests") == (0 if ranges else 1)


def _keys_of(samples: list) -> list[str]:
    return [s["__key__"] for s in samples]


def test_a_dataloader_with_two_workers_reads_each_index_once(images):
    from torch.utils.data import DataLoader, RandomSampler

    ds = ShardDataset(images)
    ds[3]  # a file opened here stays here: the workers open their own
    loader = DataLoader(ds, batch_size=4, num_workers=2, sampler=RandomSampler(ds),
                        collate_fn=_keys_of, multiprocessing_context="forkserver")
    keys = [k for batch in loader for k in batch]
    assert sorted(keys) == sorted(ds.keys()) and len(keys) == 30


def test_unknown_keys_and_indexes_out_of_range_are_named(images):
    ds = ShardDataset(images)
    with pytest.raises(IndexError, match="index 30 is out of range: .* holds 30 samples"):
        ds[30]
    with pytest.raises(KeyError, match="no sample with key 'nope'"):
        ds.get("nope")
    with pytest.raises(TypeError, match="use get"):
        ds["class_0_00001"]  # type: ignore[index]


def _with_bad_image(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    good = jpeg_bytes(1, (24, 24))
    with tarfile.open(raw / "a.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for key, data in (("k0", good), ("k1", good[: len(good) // 2] + bytes(40)),
                          ("k2", good)):
            for ext, blob in (("jpg", data), ("cls", b"1")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    run_tool("make_shards", "index", raw, check=True)
    return raw


def test_a_bad_sample_raises_naming_shard_and_key_or_is_skipped_and_counted(tmp_path):
    raw = _with_bad_image(tmp_path)
    ds = ShardDataset(raw)
    assert ds[0]["label"] == 1
    with pytest.raises(DataError, match=r"a\.tar.*k1|k1.*a\.tar") as err:
        ds[1]
    assert err.value.key == "k1"
    skipping = ShardDataset(raw, on_error="skip")
    assert skipping[1] is None and [s["key"] for s in skipping.skipped.entries] == ["k1"]
    batch = collate_skipping([skipping[i] for i in range(3)])
    assert batch["__key__"] == ["k0", "k2"] and batch["image"].shape == (2, 24, 24, 3)


def test_a_shard_without_an_index_names_the_command_that_makes_one(tmp_path):
    raw = _with_bad_image(tmp_path)
    (raw / "a.idx").unlink()
    (raw / "manifest.json").unlink()
    with pytest.raises(DataError, match="no index at .*a.idx.*shardflow index"):
        ShardDataset(raw)


def test_a_fifo_in_an_index_place_is_refused_not_opened(tmp_path):
    raw = _with_bad_image(tmp_path)
    (raw / "a.idx").unlink()
    (raw / "manifest.json").unlink()
    os.mkfifo(raw / "a.idx")
    with deadline(60), pytest.raises(DataError, match="a.idx is not a regular file") as err:
        ShardDataset(raw)
    assert err.value.reason == "bad-index" and err.value.source.endswith("a.tar")


def test_text_stored_ids_and_point_clouds_decode_as_their_loaders_read_them(tmp_path):
    docs = make_text_corpus(tmp_path / "docs", docs=12)
    convert(ConvertConfig(kind="text", src=str(docs), out=tmp_path / "text", max_count=5,
                          workers=1))
    convert(ConvertConfig(kind="text", src=str(docs), out=tmp_path / "ids", max_count=5,
                          workers=1, text=TextOptions(tokenizer="bytes")))
    text, ids = ShardDataset(tmp_path / "text"), ShardDataset(tmp_path / "ids")
    for key in text.keys():
        want = (docs / f"{key}.txt").read_text(encoding="utf-8")
        assert text.get(key)["text"] == want
        assert bytes(ids.get(key)["tokens"].astype(np.uint8)) == want.encode()
    with text_loader(tmp_path / "ids", batch_size=2, seq_len=16, device="cpu") as loader:
        assert sum(len(b.keys) for b in loader)  # the same shards load
    clouds = make_pointcloud_folder(tmp_path / "pc", per_class=2, points=50)
    convert(ConvertConfig(kind="pointcloud", src=str(clouds), out=tmp_path / "pcs",
                          max_count=3, workers=1))
    pcs = ShardDataset(tmp_path / "pcs")
    sample = pcs[0]
    assert sample["points"].dtype == np.float32 and sample["points"].shape[1] >= 3
    assert sample["points"].shape[0] == 50 and isinstance(sample["label"], int)
    assert json.loads(json.dumps(pcs.keys()))  # plain strings


def test_remote_shards_in_the_shard_cache_are_read_from_it(images, tmp_path):
    cache = tmp_path / "cache"
    with http_server(images, RangeHandler) as url:
        with image_loader(f"{url}/manifest.json", batch_size=8, size=40, device="cpu",
                          reader="stream", cache_dir=str(cache)) as loader:
            assert sum(len(b) for b in loader) == 30
        ds = ShardDataset(f"{url}/manifest.json", cache_dir=cache)
        keys = ds.keys()  # the indexes are read from the server
    # the server is gone: the samples come from the cached shards
    local = ShardDataset(images)
    for i in (0, 17, 29):
        assert ds[i]["__key__"] == keys[i]
        assert np.array_equal(ds[i]["image"], local[i]["image"])


def test_numpy_indexes_a_bounded_number_of_open_files_and_close(images, monkeypatch):
    import os

    from pipeline.access import dataset

    monkeypatch.setattr(dataset, "OPEN_FILES", 2)
    ds = ShardDataset(images)
    before = len(os.listdir("/proc/self/fd"))
    keys = [ds[np.int64(i)]["__key__"] for i in range(len(ds))]  # five shards
    assert keys == ds.keys()
    assert len(os.listdir("/proc/self/fd")) - before <= 2
    ds.close()
    assert len(os.listdir("/proc/self/fd")) <= before


def test_stats_count_a_bad_label_apart(tmp_path):
    from pipeline.access import stats

    raw = tmp_path / "raw"
    raw.mkdir()
    with tarfile.open(raw / "a.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for key, label in (("k0", b"1"), ("k1", b"cat"), ("k2", b"2")):
            for ext, blob in (("jpg", jpeg_bytes(3, (20, 16))), ("cls", label)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    run_tool("make_shards", "index", raw, check=True)
    found = stats.gather(ShardDataset(raw))
    assert found["bad"] == {"bad-label": 1} and found["classes"] == {"1": 1, "2": 1}
    assert found["width"]["bins"][0][2] == 2  # the bad sample is counted nowhere else
