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

from shardflow import ShardDataset, collate_skipping, image_loader, text_loader
from shardflow.builtin import make_image_folder, make_pointcloud_folder, make_text_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.convert.sources import TextOptions
from shardflow.errors import DataError


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


def test_a_shard_given_by_its_path_is_decoded_as_its_members_say(images, tmp_path):
    """No manifest is read for one shard's path: its members name the modality, so its
    images are decoded and checked, not handed back as bytes."""
    first = sorted(images.glob("*.tar"))[0]
    alone, whole = ShardDataset(str(first)), ShardDataset(images)
    assert alone.source.modality == "image" and len(alone) == 7
    for i in range(len(alone)):
        assert np.array_equal(alone[i]["image"], whole[i]["image"])
    raw = _with_bad_image(tmp_path)
    with pytest.raises(DataError, match=r"k1.*\[bad-image\]"):
        ShardDataset(str(raw / "a.tar"))[1]


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

    from shardflow.access import dataset

    monkeypatch.setattr(dataset, "OPEN_FILES", 2)
    ds = ShardDataset(images)
    before = len(os.listdir("/proc/self/fd"))
    keys = [ds[np.int64(i)]["__key__"] for i in range(len(ds))]  # five shards
    assert keys == ds.keys()
    assert len(os.listdir("/proc/self/fd")) - before <= 2
    ds.close()
    assert len(os.listdir("/proc/self/fd")) <= before


def test_stats_count_a_bad_label_apart(tmp_path):
    from shardflow.access import stats

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


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def _foreign_shard(folder: Path, samples: dict[str, dict[str, bytes]]) -> Path:
    """A shard as webdataset's TarWriter writes it, indexed (`shardflow index`)."""
    import webdataset as wds

    from shardflow.shards.indexing import index_folder

    folder.mkdir()
    with wds.TarWriter(str(folder / "s-000000.tar")) as sink:
        for key, members in samples.items():
            sink.write({"__key__": key, **members})
    index_folder(folder)
    return folder


def _read_both(folder: Path, backend: str, **options) -> tuple[dict, dict, dict, dict]:
    """({key: sample} of ShardDataset, {key: (points, offset, labels)} of the loader, and
    each one's {key: skip reason}), both under on_error="skip"."""
    from shardflow.pointcloud.loader import pointcloud_loader

    ds = ShardDataset(folder, on_error="skip")
    samples = {k: s for k in ds.keys() if (s := ds.get(k)) is not None}
    got = {}
    with pointcloud_loader(folder, batch_size=8, train=False, normalize=False, device="cpu",
                           backend=backend, on_error="skip", threads=1, **options) as loader:
        for b in loader:
            rows = b.offsets.tolist() if options.get("per_point_labels") else None
            for i, key in enumerate(b.keys):
                if rows is None:
                    got[key] = (b.points[i].numpy(), b.offset[i].numpy(), None)
                else:
                    got[key] = (b.points[rows[i]:rows[i + 1]].numpy(), b.offset[i].numpy(),
                                b.labels[rows[i]:rows[i + 1]].numpy())
        reasons = {e["key"]: e["reason"] for e in loader.skipped}
    return samples, got, {e["key"]: e["reason"] for e in ds.skipped.entries}, reasons


@pytest.mark.parametrize("backend", ["dali", "portable"])
def test_point_clouds_and_their_offsets_agree_with_the_loader(tmp_path, backend):
    """The same keys, points, offsets and skip reasons from ShardDataset and the loader:
    a float64 cloud far from the origin (offset taken), one stored relative to its own
    offset member, NaN in x (non-finite) or only in a 4th column (read by both: x, y, z are
    the coordinates), a NaN offset member, too few columns."""
    rng = np.random.default_rng(0)
    local = rng.uniform(-1, 1, (64, 4))
    far = np.array([5_123_456.0, 4_987_654.0, 120.0, 0.0])
    nan_x, nan_extra = local.astype(np.float32), local.astype(np.float32)
    nan_x[5, 0], nan_extra[5, 3] = np.nan, np.nan
    own = np.array([5e6, 4e6, 0.0])
    bad_offset = _npy(np.array([1.0, np.nan, 0.0]))
    samples = {
        "geo": {"npy": _npy(local + far)},
        "made": {"npy": _npy(local.astype(np.float32)), "offset.npy": _npy(own)},
        "plain": {"npy": _npy(local.astype(np.float32))},
        "nan_x": {"npy": _npy(nan_x)},
        "nan_extra": {"npy": _npy(nan_extra)},
        "bad_offset": {"npy": _npy(local.astype(np.float32)), "offset.npy": bad_offset},
        "flat": {"npy": _npy(local[:, :2].astype(np.float32))}}
    folder = _foreign_shard(tmp_path / "pc", {k: {**m, "cls": b"0"} for k, m in
                                              samples.items()})
    access, loaded, access_skips, loader_skips = _read_both(folder, backend, num_points=64)
    assert sorted(access) == sorted(loaded) == ["geo", "made", "nan_extra", "plain"]
    assert access_skips == loader_skips == {"nan_x": "non-finite", "bad_offset": "bad-format",
                                            "flat": "bad-shape"}
    for key, (points, offset, _) in loaded.items():
        assert np.array_equal(access[key]["points"][:, :3], points), key
        assert access[key]["offset"].dtype == np.float64
        assert np.array_equal(access[key]["offset"], offset), key
    assert np.array_equal(access["made"]["offset"], own) and access["geo"]["offset"][0] > 5e6
    assert not access["plain"]["offset"].any()
    assert np.isnan(access["nan_extra"]["points"][5, 3])  # stored as is, returned as is


@pytest.mark.parametrize("backend", ["dali", "portable"])
def test_scene_labels_agree_with_the_loader(tmp_path, backend):
    """A scene's labels are checked as the scene loader checks them (one per point, each a
    class or the ignore label) and returned as "labels"; a scene without them is refused."""
    rng = np.random.default_rng(1)
    points = rng.uniform(-4, 4, (200, 3)).astype(np.float32)
    labels = rng.integers(0, 3, 200).astype(np.uint16)
    folder = _foreign_shard(tmp_path / "scenes", {
        "ok": {"npy": _npy(points), "labels.npy": _npy(labels)},
        "short": {"npy": _npy(points), "labels.npy": _npy(labels[:150])},
        "negative": {"npy": _npy(points), "labels.npy": _npy(labels.astype(np.int16) - 3)},
        "float": {"npy": _npy(points), "labels.npy": _npy(labels.astype(np.float32))}})
    access, loaded, access_skips, loader_skips = _read_both(folder, backend,
                                                            per_point_labels=True)
    assert sorted(access) == sorted(loaded) == ["ok"]
    assert access_skips == loader_skips == {"short": "label-count", "negative": "bad-label",
                                            "float": "bad-labels"}
    assert np.array_equal(access["ok"]["labels"], loaded["ok"][2])
    assert np.array_equal(access["ok"]["points"], loaded["ok"][0])


def test_stats_bins_come_from_the_data(tmp_path):
    """Photos all 40 px wide are one bar at 40 (it was "0-64" on a fixed scale), and sizes
    spread out are cut in steps from the smallest to the largest, every sample in one."""
    from shardflow.access import stats

    raw = tmp_path / "raw"
    raw.mkdir()
    sizes = [(40, 30 + 10 * i) for i in range(6)]
    with tarfile.open(raw / "a.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for i, size in enumerate(sizes):
            blob = jpeg_bytes(i, size)
            info = tarfile.TarInfo(f"k{i}.jpg")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    run_tool("make_shards", "index", raw, check=True)
    found = stats.gather(ShardDataset(raw))
    assert found["width"]["bins"] == [[40, 40, 6]]
    heights = found["height"]["bins"]
    assert heights[0][0] == 30 and heights[-1][1] == 80
    assert [c for *_, c in heights] == [1] * 6  # six heights, six bars
    assert all(b - a in (8, 9) for a, b, _ in heights)
