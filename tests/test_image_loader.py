"""The image loader on real shards: both readers, ranks, resume, shuffling, bad data."""

from __future__ import annotations

import functools
import json
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    QuietHandler,
    copier_outputs,
    http_server,
    jpeg_bytes,
    make_image_folder,
    not_delivered,
    run_tool,
)

from shardflow import image_loader
from shardflow.builtin import make_image_folder as builtin_images
from shardflow.errors import DataError
from shardflow.image.graph import IMAGENET_MEAN, IMAGENET_STD

OPTS = {"size": 32, "threads": 1, "shuffle_buffer": 16}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 images in 10 classes, 8 per shard (8 shards, the last one short)."""
    root = tmp_path_factory.mktemp("imgshards")
    src = builtin_images(root / "src", per_class=6, size=48)
    run_tool("make_shards", "imagefolder", src, root / "out", "--max-count", 8, check=True)
    return root / "out"


def epoch(loader) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    keys, images, labels = [], [], []
    for batch in loader:
        keys += batch.keys
        images.append(batch.image)
        labels.append(batch.label)
    return keys, images, labels


@pytest.fixture(scope="module")
def http_url(shards: Path):
    """The shard folder served on 127.0.0.1 by a server the test starts and stops."""
    with http_server(shards) as url:
        yield url


@pytest.mark.backend
def test_batches_hold_decoded_images_labels_and_keys(shards):
    threads = torch.get_num_threads()
    with image_loader(shards, batch_size=16, device="cpu", **OPTS) as loader:
        # DALI's reader for local indexed shards; the portable backend (no DALI) streams.
        assert len(loader) == 4
        assert loader.reader == ("dali" if loader.backend == "dali" else "stream")
        keys, images, labels = epoch(loader)
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 60
    assert [tuple(i.shape) for i in images] == [(16, 3, 32, 32)] * 3 + [(12, 3, 32, 32)]
    assert images[0].dtype == torch.uint8 and images[0].float().std() > 10
    label_of = {k: int(k[:2]) for k in keys}  # builtin class folders are 00_circle, 01_...
    assert [label_of[k] for k in keys] == torch.cat(labels).tolist()
    assert torch.get_num_threads() == threads  # the loader leaves the consumer's torch alone


@pytest.mark.dali
def test_local_dali_stream_and_http_give_the_same_epoch(shards, http_url):
    def run(source, reader):
        with image_loader(source, batch_size=16, train=False, device="cpu", reader=reader,
                          **OPTS) as loader:
            return epoch(loader)


    dali, stream, http = run(shards, "dali"), run(shards, "stream"), run(http_url, "auto")
    assert dali[0] == stream[0] == http[0]  # eval: no shuffling, same order
    for a, b, c in zip(dali[1], stream[1], http[1], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    train = [set(epoch(image_loader(src, batch_size=16, device="cpu", reader=r, **OPTS))[0])
             for src, r in ((shards, "dali"), (http_url, "stream"))]
    assert train[0] == train[1] == set(dali[0])


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.backend
def test_ranks_are_disjoint_cover_and_run_equal_batches(shards, world_size, caplog):
    per_rank = []
    for rank in range(world_size):
        loader = image_loader(shards, batch_size=5, device="cpu", rank=rank,
                              world_size=world_size, **OPTS)
        keys = epoch(loader)[0]
        per_rank.append(keys)
        assert len(loader) == -(-len(keys) // 5)
        plan = loader.plan(0)
    lengths = {len(k) for k in per_rank}
    assert len(lengths) == 1, "every rank reads the same number of samples"
    everything = [k for keys in per_rank for k in keys]
    assert len(everything) == len(set(everything)), "ranks overlap"
    assert len(everything) + plan.dropped == 60, "read + dropped must be the whole epoch"
    if plan.dropped:
        assert "left out" in caplog.text


@pytest.mark.backend
def test_more_ranks_than_shards_is_an_error_at_build(shards):
    with pytest.raises(ValueError, match="cannot feed 9 ranks"):
        image_loader(shards, batch_size=4, device="cpu", rank=0, world_size=9, **OPTS)


@pytest.mark.parametrize("reader", ["dali", "stream"])
@pytest.mark.backend
def test_resume_mid_epoch_gives_exactly_the_rest(shards, reader):
    make = functools.partial(image_loader, shards, batch_size=8, device="cpu", seed=3,
                             reader=reader, **OPTS)
    full = make()
    epoch(full)  # epoch 0 passes; the snapshot is taken in epoch 1
    it = iter(full)
    for _ in range(3):
        next(it)
    state = full.state_dict()
    rest = list(it)
    resumed = make()
    resumed.load_state_dict(state)
    again = list(resumed)
    assert [b.keys for b in again] == [b.keys for b in rest] and len(rest) == 5
    for a, b in zip(again, rest, strict=True):
        assert torch.equal(a.image, b.image) and torch.equal(a.label, b.label)
    assert resumed.epoch == full.epoch == 2


@pytest.mark.backend
def test_state_from_another_loader_is_refused(shards):
    state = image_loader(shards, batch_size=8, device="cpu", **OPTS).state_dict()
    other = image_loader(shards, batch_size=8, device="cpu", seed=1, **OPTS)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    # A rank's own state (not gathered: no process group here) belongs to that rank; a whole
    # state resumes anywhere (test_elastic.py).
    own = image_loader(shards, batch_size=8, device="cpu", rank=0, world_size=2,
                       **OPTS).state_dict()
    assert own["rank"] == 0 and "ranks" not in own
    other_rank = image_loader(shards, batch_size=8, device="cpu", rank=1, world_size=2, **OPTS)
    with pytest.raises(ValueError, match="rank: 0 in the state, 1 here"):
        other_rank.load_state_dict(own)


@pytest.mark.backend
def test_shuffling_is_seeded_per_epoch(shards):
    def order(seed, ep):
        loader = image_loader(shards, batch_size=60, device="cpu", seed=seed, **OPTS)
        loader.set_epoch(ep)
        return epoch(loader)[0]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(1, 0) and order(0, 0) != order(0, 1)
    assert len(set(order(0, 1))) == 60  # every epoch is the whole dataset, once


@pytest.mark.backend
def test_streaming_shuffle_is_seeded_too(shards):
    def order(seed):
        return epoch(image_loader(shards, batch_size=60, device="cpu", seed=seed,
                                  reader="stream", **OPTS))[0]

    assert order(5) == order(5) != order(6)


@pytest.mark.backend
def test_nhwc_float_normalized_and_eval_center_crop(shards):
    loader = image_loader(shards, batch_size=10, device="cpu", layout="NHWC", normalize=True,
                          train=False, **OPTS)
    batch = next(iter(loader))
    assert batch.image.shape == (10, 32, 32, 3) and batch.image.dtype == torch.float32
    assert -3 < batch.image.mean() < 3 and batch.image.std() > 0.2
    # The same centre crops as the uint8 NCHW batch (checked against PIL in
    # test_eval_crop_is_the_centre_square_pil_makes), laid out NHWC, normalized per channel.
    with image_loader(shards, batch_size=10, device="cpu", train=False, **OPTS) as plain:
        raw = next(iter(plain))
    assert raw.keys == batch.keys
    mean, std = (torch.tensor(v).view(1, 1, 1, 3) for v in (IMAGENET_MEAN, IMAGENET_STD))
    expected = (raw.image.permute(0, 2, 3, 1).float() - mean) / std
    torch.testing.assert_close(batch.image, expected, atol=1.5 / 58, rtol=0)  # 1.5 of 255


def _bad_shards(tmp_path: Path, corrupt: dict[str, bytes]) -> Path:
    src = make_image_folder(tmp_path / "src", classes=2, per_class=6)
    out = tmp_path / "out"
    run_tool("make_shards", "imagefolder", src, out, "--max-count", 4, check=True)
    shard = out / "train-000001.tar"
    raw = bytearray(shard.read_bytes())
    lines = (out / "train-000001.idx").read_text().splitlines()[1:]
    for line in lines:
        f = line.split()
        for i in range(0, len(f), 4):
            name, off, size = f[i + 3], int(f[i + 1]), int(f[i + 2])
            if name in corrupt:
                new = corrupt[name][:size].ljust(size, b"\0")
                raw[off: off + size] = new
    shard.write_bytes(bytes(raw))
    return out


def _corrupt_scan(seed: int) -> bytes:
    """A JPEG whose header is fine but whose entropy-coded data is garbage."""
    good = jpeg_bytes(seed)
    rng = np.random.default_rng(seed)
    return good[:400] + rng.integers(0, 256, len(good) - 400, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("reader", ["dali", "stream"])
@pytest.mark.backend
def test_corrupt_jpeg_raises_naming_shard_and_key_or_is_skipped(tmp_path, reader):
    bad = {"class0_img004.jpg": _corrupt_scan(1), "class0_img005.cls": b"7"}
    out = _bad_shards(tmp_path, bad)
    with pytest.raises(DataError) as info:
        epoch(image_loader(out, batch_size=4, train=False, device="cpu", reader=reader, **OPTS))
    assert "train-000001.tar" in str(info.value)
    assert "class0_img004" in str(info.value) or "class0_img005" in str(info.value)
    loader = image_loader(out, batch_size=4, train=False, device="cpu", reader=reader,
                          on_error="skip", **OPTS)
    keys = epoch(loader)[0]
    assert loader.skip_counts() == {"bad-image": 1, "label-out-of-range": 1}
    assert {e["key"] for e in loader.skipped} == {"class0_img004", "class0_img005"}
    assert len(keys) + len(loader.skipped) == 12 and "class0_img004" not in keys


def _png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (a decompression bomb's calling card)."""
    import struct
    import zlib

    raw = jpeg_bytes(0, size=(4, 4), fmt="PNG")
    ihdr = struct.pack(">II", width, height) + raw[24:29]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return raw[:16] + ihdr + crc + raw[33:]


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.backend
def test_missing_label_bad_bytes_and_pixel_bomb_are_caught_before_decode(tmp_path, policy):
    from shardflow.shards.writer import ShardWriter

    writer = ShardWriter(tmp_path, "train", max_count=100, max_size=10**8)
    samples = [{"__key__": f"good{i}", "jpg": jpeg_bytes(i), "cls": b"1"} for i in range(5)]
    samples[1:1] = [{"__key__": "nolabel", "jpg": jpeg_bytes(9)},
                    {"__key__": "bomb", "png": _png_declaring(100_000, 100_000), "cls": b"0"},
                    {"__key__": "noise", "jpg": b"\xff\xd8" + bytes(300), "cls": b"0"}]
    for sample in samples:
        writer.write(sample)
    writer.finish()
    make = functools.partial(image_loader, [str(tmp_path / "train-000000.tar")], batch_size=4,
                             device="cpu", on_error=policy, **OPTS)
    if policy == "raise":
        with pytest.raises(DataError, match="train-000000.tar.*'(nolabel|bomb|noise)'"):
            epoch(make())
        return
    loader = make()
    keys = epoch(loader)[0]
    assert sorted(keys) == [f"good{i}" for i in range(5)]
    assert loader.skip_counts() == {"bad-image": 1, "missing-field": 1, "too-many-pixels": 1}


@pytest.mark.dali  # the up-front check is DALI's reader's (the streaming one finds it mid-read)
def test_truncated_shard_is_refused_up_front_or_skipped_whole(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=2, per_class=4)
    out = tmp_path / "out"
    run_tool("make_shards", "imagefolder", src, out, "--max-count", 4, check=True)
    shard = out / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    with pytest.raises(DataError, match="train-000001.tar.*truncated"):
        image_loader(out, batch_size=4, device="cpu", **OPTS)
    loader = image_loader(out, batch_size=4, device="cpu", on_error="skip", **OPTS)
    assert len(epoch(loader)[0]) == 4 and loader.skip_counts() == {"truncated": 1}
    assert "4 samples are lost" in loader.skipped[0]["detail"]  # read + lost == total


def test_missing_shards_are_listed_together(shards, tmp_path):
    pattern = str(shards / "train-{000006..000009}.tar")
    with pytest.raises(FileNotFoundError, match="2 of 4 shards are missing.*000008.*000009"):
        image_loader(pattern, batch_size=4, device="cpu")


@pytest.mark.parametrize("option, value", [("batch_size", 0), ("size", -1), ("layout", "CHW"),
                                           ("on_error", "ignore"), ("crop_scale", (0.5, 0.1)),
                                           ("device", "tpu"), ("reader", "fast"),
                                           ("resize_on", "gpu")])
@pytest.mark.backend
def test_invalid_options_name_the_option(shards, option, value):
    kwargs = {"batch_size": 4, option: value}
    with pytest.raises(ValueError, match=option):
        image_loader(shards, **kwargs)


@pytest.mark.backend
def test_unknown_option_is_refused(shards):
    with pytest.raises(TypeError, match="colour"):
        image_loader(shards, batch_size=4, colour=True)


@pytest.mark.gpu
@pytest.mark.dali  # decode="gpu" is DALI's mixed decode
def test_gpu_mixed_decode_gives_batches_on_the_device(shards):
    with image_loader(shards, batch_size=16, device="gpu", normalize=True, **OPTS) as loader:
        batch = next(iter(loader))
    assert batch.image.is_cuda and batch.image.dtype == torch.float32
    assert batch.image.shape == (16, 3, 32, 32) and batch.label.is_cuda
    # The same images as the CPU decode (nvJPEG and the GPU resize against libjpeg and
    # torch's): a mean |difference| per image under 3 levels of 255 (eval: centre crops).
    make = functools.partial(image_loader, shards, batch_size=16, train=False, normalize=True,
                             use_tuning=False, **OPTS)
    with make(device="cuda", decode="gpu") as gpu, make(device="cpu") as cpu:
        assert gpu.decode == "gpu" and cpu.decode == "cpu"
        on_gpu = [(b.keys, b.image.cpu(), b.label.cpu()) for b in gpu]
        on_cpu = [(b.keys, b.image, b.label) for b in cpu]
    to_levels = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    for (keys, image, label), (cpu_keys, cpu_image, cpu_label) in zip(on_gpu, on_cpu,
                                                                      strict=True):
        assert keys == cpu_keys and torch.equal(label, cpu_label)
        levels = ((image - cpu_image) * to_levels).abs().mean((1, 2, 3))
        assert (levels < 3).all(), dict(zip(keys, levels.tolist(), strict=True))


@pytest.mark.gpu
def test_cuda_batches_decoded_on_the_cpu_are_the_cpu_batches(shards):
    """device="cuda", decode="cpu": the CPU loader's work, copied through the pinned ring;
    uint8, so every batch of the epoch is exactly the device="cpu" batch."""
    make = functools.partial(image_loader, shards, batch_size=8, seed=4, use_tuning=False,
                             **OPTS)
    with make(device="cuda", decode="cpu") as cuda, make(device="cpu") as cpu:
        assert (cuda.device, cuda.decode) == (f"cuda:{torch.cuda.current_device()}", "cpu")
        copied = [(b.keys, b.image, b.label) for b in cuda]
        made = [(b.keys, b.image, b.label) for b in cpu]
    assert len(copied) == len(made) == 8
    for (keys, image, label), (cpu_keys, cpu_image, cpu_label) in zip(copied, made,
                                                                      strict=True):
        assert image.is_cuda and label.is_cuda and image.dtype == torch.uint8
        assert keys == cpu_keys
        assert torch.equal(image.cpu(), cpu_image) and torch.equal(label.cpu(), cpu_label)


@pytest.mark.parametrize("extra", [{}, {"normalize": True}], ids=["uint8", "normalized"])
@pytest.mark.backend
def test_every_tensor_of_an_image_batch_comes_out_of_the_copier(shards, monkeypatch, extra):
    """The CPU twin of the test above: the image and the labels are what the copier hands
    out, so on a GPU they land there (normalized there when asked)."""
    outputs = copier_outputs(monkeypatch)
    with image_loader(shards, batch_size=8, seed=4, use_tuning=False, device="cpu",
                      **OPTS, **extra) as loader:
        batches = list(loader)
    assert batches and all(b.image is not None and b.label is not None for b in batches)
    assert [not_delivered(b, outputs) for b in batches] == [[]] * len(batches)


@pytest.mark.parametrize("reader", ["dali", "stream"])
@pytest.mark.backend
def test_break_then_continue_is_the_same_as_one_pass(shards, reader):
    """A pass left early (break) must not leave batches in flight for the next pass."""
    make = functools.partial(image_loader, shards, batch_size=8, device="cpu", seed=1,
                             reader=reader, **OPTS)
    whole = list(make())
    loader = make()
    for i, _ in enumerate(loader):
        if i == 2:
            break
    rest = list(loader)
    assert [b.keys for b in rest] == [b.keys for b in whole[3:]]
    for a, b in zip(rest, whole[3:], strict=True):
        assert torch.equal(a.image, b.image)


@pytest.mark.backend
def test_close_during_iteration_stops_quietly_and_leaves_no_thread(shards, caplog):
    """close() stops and joins the producer threads before it returns (Stage.close: a stop
    event their queue waits poll every 0.1 s; it gives up, with a warning, after 5 s), and
    a consumer's next wait sees the stop before the queue: no batch comes after close()."""
    before = threading.active_count()
    loader = image_loader(shards, batch_size=4, device="cpu", **OPTS)
    seen, after_close = 0, None
    for _ in loader:
        seen += 1
        if seen == 2:
            queued = loader._stage._queue  # the batches prepared ahead of this consumer
            with queued.not_empty:  # notified by every put: wait until the queue is full
                assert queued.not_empty.wait_for(
                    lambda q=queued: q._qsize() >= q.maxsize, timeout=60)
            loader.close()
            after_close = threading.active_count()
    assert seen == 2  # ended at once, without an error, though batches were queued
    assert after_close == before and threading.active_count() == before
    assert "did not stop" not in caplog.text  # joined, not abandoned after the timeout
    assert loader.epoch == 0  # a pass cut short does not count as an epoch
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader).__next__()


@pytest.mark.backend
def test_eval_batch_is_the_centre_crop_of_the_image(shards):
    from PIL import Image

    from shardflow.image import resize
    from shardflow.image.augment import center_crop

    batch = next(iter(image_loader(shards, batch_size=4, train=False, device="cpu", **OPTS)))
    tar = tarfile.open(shards / "train-000000.tar")
    names = {m.name.split(".")[0]: m for m in tar.getmembers() if not m.name.endswith("cls")}
    for i, key in enumerate(batch.keys):
        img = np.asarray(Image.open(tar.extractfile(names[key])).convert("RGB"))
        w = center_crop(img.shape[1], img.shape[0], 0.875)
        window = img[w.y: w.y + w.height, w.x: w.x + w.width]
        expected = resize.batch([np.ascontiguousarray(window)], [False], 32, True, None)[0]
        assert (batch.image[i].float() - expected.float()).abs().mean() < 4


def _pil_centre_crop(data: bytes, size: int, fraction: float, shift: int = 0) -> torch.Tensor:
    """The reference, by PIL alone: the centred square of `fraction` of the shorter side
    (moved `shift` pixels right), resized to size x size, bilinear and antialiased."""
    import io

    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB")
    side = round(min(img.size) * fraction)
    left, top = (img.width - side) // 2 + shift, (img.height - side) // 2
    img = img.crop((left, top, left + side, top + side))
    img = img.resize((size, size), Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float()


@pytest.mark.parametrize("resize_on, fraction", [
    ("torch", 0.875), pytest.param("dali", 0.6, marks=pytest.mark.dali)])
@pytest.mark.backend
def test_eval_crop_is_the_centre_square_pil_makes(tmp_path, resize_on, fraction):
    """Noise JPEGs of several shapes (landscape, portrait, square, odd sides): every eval
    image against PIL's centre crop of the same bytes. Measured mean |difference| per image
    (0..255): at most 0.08 (torch resize) and 0.48 (the graph's); the same crop one pixel
    to the right differs by 12 or more."""
    from shardflow.shards.writer import ShardWriter

    shapes = [(60, 40), (40, 64), (48, 48), (75, 50), (33, 47), (64, 37)]
    data = {f"img{i:02d}": jpeg_bytes(i, size=s) for i, s in enumerate(shapes * 2)}
    writer = ShardWriter(tmp_path, "train", max_count=100, max_size=10**8)
    for key, jpeg in data.items():
        writer.write({"__key__": key, "jpg": jpeg, "cls": b"0"})
    writer.finish()
    seen = []
    with image_loader([str(tmp_path / "train-000000.tar")], batch_size=5, train=False,
                      device="cpu", size=24, crop_fraction=fraction, threads=1,
                      resize_on=resize_on, use_tuning=False) as loader:
        for batch in loader:
            for key, image in zip(batch.keys, batch.image.float(), strict=True):
                seen.append(key)
                same = (image - _pil_centre_crop(data[key], 24, fraction)).abs().mean()
                moved = (image - _pil_centre_crop(data[key], 24, fraction, 1)).abs().mean()
                assert same < 1.5 < moved, (key, float(same), float(moved))
    assert sorted(seen) == sorted(data)


def _damaged_middle(tmp_path: Path) -> Path:
    src = make_image_folder(tmp_path / "src", classes=2, per_class=5)
    out = tmp_path / "out"
    run_tool("make_shards", "imagefolder", src, out, "--max-count", 5, check=True)
    shard = out / "train-000000.tar"
    raw = bytearray(shard.read_bytes())
    second = (out / "train-000000.idx").read_text().splitlines()[2].split()
    header = int(second[1]) - 512  # the header block of the second sample's first member
    raw[header: header + 100] = b"\x01" * 100
    shard.write_bytes(bytes(raw))
    return out


@pytest.mark.backend
def test_streaming_ranks_stay_in_step_when_a_shard_breaks(tmp_path):
    out = _damaged_middle(tmp_path)
    counts = []
    for rank in range(2):
        loader = image_loader(out, batch_size=4, device="cpu", reader="stream",
                              on_error="skip", rank=rank, world_size=2, **OPTS)
        counts.append((len(loader), len(list(loader))))
    assert counts[0] == counts[1] == (2, 2)  # the same batch count, whatever was lost


@pytest.mark.backend
def test_streaming_resume_counts_each_skip_once(tmp_path):
    out = _damaged_middle(tmp_path)
    make = functools.partial(image_loader, out, batch_size=2, device="cpu", reader="stream",
                             on_error="skip", train=False, **OPTS)
    whole = make()
    epoch(whole)
    part = make()
    it = iter(part)
    next(it)
    state = part.state_dict()
    part.close()
    resumed = make()
    resumed.load_state_dict(state)
    epoch(resumed)
    assert resumed.skip_counts() == whole.skip_counts() and len(whole.skipped) >= 1
    json.dumps(state)  # the state is plain JSON (a checkpoint file can hold it)


@pytest.mark.backend
def test_fetch_failures_never_show_url_secrets(tmp_path, monkeypatch):
    from shardflow.loading import fetch

    monkeypatch.setattr(fetch, "BACKOFF_S", 0.01)
    (tmp_path / "a.tar").write_bytes(b"x" * 2048)
    with http_server(tmp_path, _BrokenHandler) as base:
        url = f"{base}/a.tar?X-Amz-Signature=SECRETSIG&token=SECRETTOK"
        with pytest.raises(DataError) as info:
            epoch(image_loader([url], batch_size=2, device="cpu", **OPTS))
        loader = image_loader([url], batch_size=2, device="cpu", on_error="skip", **OPTS)
        with pytest.raises(DataError, match="every sample of epoch 0 was skipped") as empty:
            epoch(loader)  # the only shard was lost: an error, not an empty epoch
    text = str(info.value) + str(empty.value) + json.dumps(loader.skipped) + \
        json.dumps(loader.state_dict())
    assert "fetch-failed" in text and "SECRET" not in text
    assert "failed 4 times" in str(info.value)  # the first try and three retries


class _BrokenHandler(QuietHandler):
    """The shard is there, but every download drops the connection part way through."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        self.wfile.write(b"\0" * 1000)
        self.close_connection = True


class _FlakyRangeHandler(QuietHandler):
    """Serves byte ranges, but drops the first download of every file part way through."""

    dropped: set[str] = set()

    def do_GET(self) -> None:
        path = self.translate_path(self.path)
        data = Path(path).read_bytes()
        start = int(self.headers.get("Range", "bytes=0-").split("=")[1].split("-")[0] or 0)
        end_text = self.headers.get("Range", "bytes=0-").split("-")[1]
        end = int(end_text) + 1 if end_text else len(data)
        self.send_response(206 if "Range" in self.headers else 200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if path not in self.dropped and end - start > 4096:
            self.dropped.add(path)
            self.wfile.write(data[start: start + 4096])
            self.close_connection = True
            return
        self.wfile.write(data[start:end])


@pytest.mark.backend
def test_a_dropped_download_is_resumed_and_nothing_is_lost(shards, monkeypatch):
    from shardflow.loading import fetch

    monkeypatch.setattr(fetch, "BACKOFF_S", 0.01)
    monkeypatch.setattr(fetch, "CHUNK", 16384)
    _FlakyRangeHandler.dropped = set()
    with http_server(shards, _FlakyRangeHandler) as base:
        loader = image_loader(base, batch_size=16, train=False, device="cpu", **OPTS)
        keys = epoch(loader)[0]
    assert len(_FlakyRangeHandler.dropped) >= 8  # every shard broke once
    assert sorted(keys) == sorted(epoch(image_loader(shards, batch_size=16, train=False,
                                                     device="cpu", **OPTS))[0])
    assert not loader.skipped


@pytest.mark.dali  # hangs DALI's reader
def test_a_hung_reader_is_reported_within_the_timeout(shards, monkeypatch):
    from shardflow.loading import reader_dali

    stop_hanging = threading.Event()
    real = reader_dali.batches

    def hangs_after_one(plan, state, **options):
        it = real(plan, state, **options)
        yield next(it)
        stop_hanging.wait(30)  # a stalled read: nothing more comes
        yield from it

    monkeypatch.setattr(reader_dali, "batches", hangs_after_one)
    loader = image_loader(shards, batch_size=8, device="cpu", timeout_s=1.5, **OPTS)
    try:
        waiting_since = time.monotonic()
        with pytest.raises(TimeoutError, match="shardflow-image produced nothing for 2 s"):
            epoch(loader)
        # Raised after the 1.5 s it was given, not before, and long before the read would
        # have come back at 30 s (the slack is for a busy machine: a bound, not a speed).
        assert 1.5 <= time.monotonic() - waiting_since <= 1.5 + 15
    finally:
        stop_hanging.set()  # let the stuck thread finish so no thread is left behind
        loader.close()


@pytest.mark.parametrize("reader", ["dali", "stream"])
@pytest.mark.backend
def test_a_state_saved_after_the_epochs_last_batch_resumes_with_the_next_epoch(shards, reader):
    make = functools.partial(image_loader, shards, batch_size=8, device="cpu", reader=reader,
                             **OPTS)
    with make() as reference:
        epoch(reference)
        want = epoch(reference)[0]  # epoch 1
    with make() as first:
        for n, _ in enumerate(first, 1):
            if n == len(first):
                break  # a checkpoint taken after the last batch, before the pass ended
        state = first.state_dict()
    with make() as resumed:
        resumed.load_state_dict(state)
        assert epoch(resumed)[0] == want and resumed.epoch == 2


@pytest.mark.dali  # resize_on="dali" is the graph's resize
@pytest.mark.parametrize("train, normalize, layout, tolerance", [
    (False, False, "NCHW", 1.5), (True, True, "NHWC", 0.03)])
def test_resize_in_the_graph_or_in_torch_gives_the_same_images(shards, train, normalize, layout,
                                                               tolerance):
    """resize_on (a --tune choice): the DALI graph's resize, flip and normalize on the CPU
    against torch's, on the same windows and flips: the same images within resampling noise,
    and far from the mirror image."""
    got = {}
    for on in ("torch", "dali"):
        loader = image_loader(shards, batch_size=8, train=train, device="cpu", resize_on=on,
                              normalize=normalize, layout=layout, use_tuning=False, **OPTS)
        got[on] = {k: img.float() for b in loader for k, img in zip(b.keys, b.image,
                                                                     strict=True)}
    assert got["torch"].keys() == got["dali"].keys()
    width = -1 if layout == "NCHW" else -2
    for key, image in got["dali"].items():
        same = (image - got["torch"][key]).abs().mean().item()
        mirrored = (image.flip(width) - got["torch"][key]).abs().mean().item()
        assert same < tolerance < mirrored, (key, same, mirrored)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.backend
def test_kept_batches_are_never_overwritten_and_dropped_ones_are_reused(shards, normalize):
    """The decode stage writes batches into reused buffers (loading/hostpool.py): a batch the
    user keeps must stay as it was, and the buffers of dropped ones are written again."""
    opts = {**OPTS, "normalize": normalize}
    with image_loader(shards, batch_size=8, device="cpu", seed=3, **opts) as loader:
        copied = [(b.keys, b.image.clone()) for b in loader]  # the reference: copies
    with image_loader(shards, batch_size=8, device="cpu", seed=3, **opts) as loader:
        held = [(b.keys, b.image) for b in loader]  # the same epoch, the batches all kept
        assert loader._decoder.pool.reused == 0
        sums = [b.image.double().sum().item() for b in loader]  # each let go at once
        assert loader._decoder.pool.reused > 0  # written into the first pass's buffers
    assert [k for k, _ in copied] == [k for k, _ in held]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(copied, held, strict=True))
    assert len(sums) == len(held) and all(s != 0 for s in sums)


@pytest.mark.backend
def test_a_torch_dataloader_hands_the_batches_on_as_they_are(shards):
    """Loaders are IterableDatasets: DataLoader(loader, batch_size=None) gives the loader's own
    batches, and refuses worker processes (each would read the whole epoch again)."""
    from torch.utils.data import DataLoader, IterableDataset

    make = functools.partial(image_loader, shards, batch_size=16, device="cpu", seed=4, **OPTS)
    with make() as direct:
        want = [(b.keys, b.image.clone(), b.label) for b in direct]
    with make() as loader:
        assert isinstance(loader, IterableDataset)
        wrapped = DataLoader(loader, batch_size=None)
        assert len(wrapped) == len(loader) == 4
        got = [(b.keys, b.image.clone(), b.label) for b in wrapped]
        assert type(next(iter(wrapped))).__name__ == "ImageBatch"
    assert [k for k, _, _ in got] == [k for k, _, _ in want]
    assert all(torch.equal(a, b) and torch.equal(la, lb)
               for (_, a, la), (_, b, lb) in zip(got, want, strict=True))
    with make() as loader:
        workers = iter(DataLoader(loader, batch_size=None, num_workers=1))
        try:
            with pytest.raises(RuntimeError, match="num_workers=0"):
                next(workers)
        finally:
            workers._shutdown_workers()  # type: ignore[attr-defined]  # its queue's thread too


@pytest.mark.backend
def test_an_evaluation_pass_starts_at_the_beginning_and_a_training_pass_continues(shards):
    """train=False: a pass cut short (a sanity check) does not shorten the next one, except
    right after load_state_dict; train=True: the next pass continues the epoch."""
    make = functools.partial(image_loader, shards, batch_size=8, device="cpu", seed=2, **OPTS)
    with make(train=False) as evaluation:
        whole = [k for b in evaluation for k in b.keys]
        for _ in evaluation:  # two batches, then stopped
            if evaluation._batches_done == 2:
                state = evaluation.state_dict()
                break
        assert [k for b in evaluation for k in b.keys] == whole  # from the start again
        assert [k for b in evaluation for k in b.keys] == whole
    with make(train=False) as restored:
        restored.load_state_dict(state)
        assert [k for b in restored for k in b.keys] == whole[16:]  # continues the state once
        assert [k for b in restored for k in b.keys] == whole
    with make(train=True) as training:
        first = next(iter(training)).keys
        rest = [k for b in training for k in b.keys]  # the rest of the same epoch
        assert len(first) + len(rest) == 60 and not set(first) & set(rest)


@pytest.mark.dali  # DALI's own reader
def test_the_next_epochs_reader_started_ahead_gives_that_epoch(shards):
    """DALI's reader of epoch e + 1 starts when epoch e's reads end (its shuffle buffer
    fills while the last batches decode): the next pass reads exactly what a loader started
    at epoch e + 1 reads; a state loaded, or an epoch set, drops it unused."""
    make = functools.partial(image_loader, shards, batch_size=8, device="cpu", seed=2,
                             reader="dali", **OPTS)
    with make() as ahead, make() as fresh:
        first = epoch(ahead)
        assert _eventually(lambda: ahead._primed._pipe is not None), "not started ahead"
        assert ahead._primed._key[0] == ahead.plan() and ahead.plan().epoch == 1
        second = epoch(ahead)
        fresh.set_epoch(1)
        assert fresh._primed._pipe is None
        want = epoch(fresh)
        assert second[0] == want[0] and second[0] != first[0]
        assert all(torch.equal(a, b) for a, b in zip(second[1], want[1], strict=True))
        state = ahead.state_dict()  # after epoch 1, with epoch 2's reader waiting
        assert ahead._primed._pipe is not None
        ahead.load_state_dict(state)
        assert ahead._primed._pipe is None
        assert epoch(ahead)[0] == epoch(fresh)[0]  # epoch 2, built afresh on both


@pytest.mark.dali  # DALI's own reader
def test_a_reader_started_ahead_is_dropped_by_a_pass_that_continues_its_epoch(
        shards, caplog, monkeypatch):
    make = functools.partial(image_loader, shards, batch_size=8, device="cpu", seed=3,
                             reader="dali", **OPTS)
    with make() as loader:
        whole = epoch(loader)
    with make() as loader:
        for i, _ in enumerate(loader):
            if i == 5:  # the reader stage has read the epoch (60 samples) by now
                break
        assert _eventually(lambda: loader._primed._pipe is not None)  # epoch 1's reader
        unused, asked = loader._primed._pipe, []
        take = loader._primed.take
        monkeypatch.setattr(loader._primed, "take", lambda plan, *a: asked.append(
            (plan.epoch, take(plan, *a))) or asked[-1][1])
        rest = iter(loader)
        next(rest)
        # Handed back to this pass, which continues epoch 0 from a state: dropped unused
        # (reading epoch 0's end, the pass starts epoch 1's reader again, afresh).
        assert [epoch for epoch, _ in asked] == [0] and asked[0][1] is None
        assert loader._primed._pipe is not unused
        assert [k for b in [*list(rest)] for k in b.keys] == whole[0][8 * 7:]
    # A failure to start it ahead is not the epoch's: it is logged, the epoch ends whole.
    from shardflow.loading import reader_dali

    def broken(self, plan, exts, extras):
        raise OSError("no file descriptors left")

    monkeypatch.setattr(reader_dali.Primed, "start", broken)
    with make() as loader, caplog.at_level("WARNING"):
        assert epoch(loader)[0] == whole[0]
    assert "was not started ahead: no file descriptors left" in caplog.text


def _eventually(condition, seconds: float = 10.0) -> bool:
    """Whether `condition()` holds within `seconds` (the reader stage's thread sets it)."""
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.01)
    return True
