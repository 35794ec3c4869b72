"""Pipelines you compose (pipeline/compose/): fields, per-sample Python, resume, ranks, skips.

The shards are written by webdataset's own TarWriter in img2dataset's layout (`.jpg .txt
.json` per key), then indexed by `shardflow index`'s function; the references are PIL, the
UTF-8 bytes of each caption, HF tokenizers called directly, and the image loader's own batches.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import import_or_skip
from PIL import Image

import shardflow as sf
from shardflow import image_loader, merge_states
from shardflow.errors import DataError
from shardflow.shards.indexing import index_folder

BAD = {5: "bad-utf8", 17: "bad-json", 29: "bad-image"}  # sample number -> what is wrong
SAMPLES, PER_SHARD = 36, 12
OPTS = {"shuffle_buffer": 10, "prefetch": 2}


def caption(n: int) -> str:
    return f"a photo, number {n} — café"  # not ASCII: the tokens are UTF-8 bytes


@pytest.fixture(scope="module")
def laion(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three shards of 12 samples as img2dataset writes them, with one bad caption (invalid
    UTF-8), one bad JSON and one cut-off JPEG."""
    wds = import_or_skip("webdataset")
    out = tmp_path_factory.mktemp("laion")
    rng = np.random.default_rng(0)
    for s in range(SAMPLES // PER_SHARD):
        with wds.TarWriter(str(out / f"{s:05d}.tar")) as writer:
            for k in range(PER_SHARD):
                n = s * PER_SHARD + k
                pixels = rng.integers(0, 255, (36 + 2 * k, 52 - k, 3), dtype=np.uint8)
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, "JPEG", quality=90)
                sample = {"__key__": f"{n:09d}", "jpg": buf.getvalue(),
                          "txt": caption(n).encode(), "json": json.dumps(
                              {"key": f"{n:09d}", "caption": caption(n)}).encode()}
                if BAD.get(n) == "bad-utf8":
                    sample["txt"] = b"caption \xff\xfe"
                elif BAD.get(n) == "bad-json":
                    sample["json"] = b'{"key": '
                elif BAD.get(n) == "bad-image":
                    sample["jpg"] = sample["jpg"][:40]
                writer.write(sample)
    index_folder(out)
    return out


def captions(laion: Path, **options):  # type: ignore[no-untyped-def]
    return (sf.Pipeline(laion, seed=3, on_error="skip", **{**OPTS, **options})
            .fields(jpg=sf.fields.Image(size=24, train=True),
                    txt=sf.fields.Tokens("bytes", length=40),
                    json=sf.fields.Json())
            .batch(8).to("cpu"))


def good_keys() -> set[str]:
    return {f"{n:09d}" for n in range(SAMPLES) if n not in BAD}


@pytest.mark.parametrize("backend", ["dali", "portable"])
def test_image_caption_json_batches_and_named_skips(laion, backend):
    with captions(laion, backend=backend).loader() as loader:
        batches = list(loader)
        counts, skipped = loader.skip_counts(), loader.skipped
    keys = [k for b in batches for k in b.keys]
    assert sorted(keys) == sorted(good_keys())  # each good sample once, the bad ones skipped
    assert counts == {"bad-image": 1, "bad-json": 1, "bad-utf8": 1}
    named = {e["key"]: e for e in skipped}
    for n, reason in BAD.items():
        entry = named[f"{n:09d}"]
        assert entry["reason"] == reason and entry["source"].endswith(f"{n // 12:05d}.tar")
    assert ".txt" in named[f"{5:09d}"]["detail"] and ".json" in named[f"{17:09d}"]["detail"]
    for batch in batches:
        assert batch["jpg"].shape == (len(batch), 3, 24, 24) and batch["jpg"].dtype == torch.uint8
        assert batch["txt"].shape == (len(batch), 40) and batch["txt"].dtype == torch.int64
        for i, key in enumerate(batch.keys):
            text = caption(int(key)).encode()  # the byte tokenizer's ids are the UTF-8 bytes
            want = list(text[:40]) + [256] * (40 - len(text))
            assert batch["txt"][i].tolist() == want
            assert int(batch.lengths["txt"][i]) == min(len(text), 40)
            assert batch["json"][i] == {"key": key, "caption": caption(int(key))}


@pytest.mark.parametrize("backend", ["dali", "portable"])
def test_pixels_are_the_image_loaders(laion, backend):
    """The pipeline's image field is the image loader's path whole: the same pixels."""
    with captions(laion, backend=backend).loader() as loader:
        mine = {k: img for b in loader for k, img in zip(b.keys, b["jpg"], strict=True)}
    with image_loader(laion, batch_size=8, seed=3, on_error="skip", labels=False, size=24,
                      device="cpu", backend=backend, **OPTS) as plain:
        theirs = {k: img for b in plain for k, img in zip(b.keys, b.image, strict=True)}
    # the image loader does not check the captions: it reads the two samples they spoil
    assert set(theirs) - set(mine) == {f"{5:09d}", f"{17:09d}"}
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("backend", ["dali", "portable"])
def test_killed_mid_epoch_resumes_bit_identical(laion, backend, tmp_path):
    """SIGKILL after the second batch (a child process, tests/pipeline_killed.py); a new
    pipeline given the last state it wrote goes on with exactly the batches an uninterrupted
    run gives: pixels, tokens, JSON and keys, digest for digest."""
    from pipeline_killed import build, digest

    out = tmp_path / "killed.jsonl"
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "pipeline_killed.py"),
                           str(laion), backend, "2", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2
    with build(str(laion), backend).loader() as whole:
        want = [digest(b) for b in whole]
    with build(str(laion), backend).loader() as resumed:
        resumed.load_state_dict(lines[-1]["state"])
        again = [digest(b) for b in resumed]
        skips = resumed.skip_counts()
    assert [line["digest"] for line in lines] == want[:2]
    assert again == want[2:] and again
    assert skips == {"bad-image": 1, "bad-json": 1, "bad-utf8": 1}  # each counted once


def two_ranks_one_batch_each(pipe):  # type: ignore[no-untyped-def]
    """Ranks 0 and 1 of 2 in this process take a batch each: (their keys, the whole state
    through JSON, what their filters left out)."""
    loaders = [pipe.loader(rank=r, world_size=2) for r in range(2)]
    seen = [k for loader in loaders for k in next(iter(loader)).keys]
    state = merge_states([lo.state_dict(gather=False) for lo in loaders])  # pipeline states
    filtered = sum(sum(lo.filtered_counts().values()) for lo in loaders)
    for lo in loaders:
        lo.close()
    return seen, json.loads(json.dumps(state)), filtered


def test_two_ranks_resumed_on_one_read_each_sample_once(laion):
    pipe = captions(laion, backend="portable").filter(lambda s, rng: int(s["__key__"]) % 4)
    seen, state, before = two_ranks_one_batch_each(pipe)
    with pipe.loader(rank=0, world_size=1) as one:
        one.load_state_dict(state)
        seen += [k for b in one for k in b.keys]
        filtered = one.filtered_counts()
    want = {k for k in good_keys() if int(k) % 4}
    assert sorted(seen) == sorted(want)  # every kept sample exactly once
    assert before > 0 and filtered == {"filter <lambda>": 9}  # 0, 4, .., 32: none is bad
    assert one.skip_counts() == {"bad-image": 1, "bad-json": 1, "bad-utf8": 1}


def radar(data: bytes) -> np.ndarray:
    """A member type of our own: 4-byte magic, then float32 values."""
    if data[:4] != b"RDR1":
        raise ValueError("no RDR1 magic")
    return np.frombuffer(data[4:], dtype=np.float32).copy()


@pytest.fixture(scope="module")
def radar_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wds = import_or_skip("webdataset")
    out = tmp_path_factory.mktemp("radar")
    with wds.TarWriter(str(out / "00000.tar")) as writer:
        for n in range(12):
            buf = io.BytesIO()
            Image.new("RGB", (30, 20), (n * 20, 0, 0)).save(buf, "PNG")
            frame = b"RDR1" + np.full(3, n, dtype=np.float32).tobytes()
            if n == 4:
                frame = b"XXXX" + frame[4:]
            writer.write({"__key__": f"s{n:02d}", "png": buf.getvalue(), "rdr": frame,
                          "cls": str(n % 3).encode()})
    index_folder(out)
    return out


def test_users_decoder_and_map_errors_are_named_skips_filter_counted_apart(radar_shards):
    def scaled(sample, rng):
        if sample["__key__"] == "s07":
            raise ValueError("refuses s07")
        return {**sample, "rdr": sample["rdr"] * 2}

    pipe = (sf.Pipeline(radar_shards, on_error="skip", backend="portable", **OPTS)
            .fields(png=sf.fields.Image(size=16, train=False),
                    rdr=sf.fields.Decoder(radar), cls=sf.fields.Int(num_classes=3))
            .map(scaled).filter(lambda s, rng: s["__key__"] != "s09").batch(4).to("cpu"))
    with pipe.loader() as loader:
        batches = list(loader)
        assert loader.skip_counts() == {"bad-member": 1, "step-error": 1}
        assert loader.filtered_counts() == {"filter <lambda>": 1}
        named = {e["key"]: e["detail"] for e in loader.skipped}
    assert "radar raised ValueError: no RDR1 magic" in named["s04"]
    assert "map scaled" in named["s07"] and "refuses s07" in named["s07"]
    keys = [k for b in batches for k in b.keys]
    assert sorted(keys) == [f"s{n:02d}" for n in range(12) if n not in (4, 7, 9)]
    for b in batches:
        assert b["rdr"].dtype == torch.float32 and b["rdr"].shape == (len(b), 3)
        assert b["rdr"][:, 0].tolist() == [2.0 * int(k[1:]) for k in b.keys]
        assert b["cls"].tolist() == [int(k[1:]) % 3 for k in b.keys]
    with pytest.raises(DataError, match="s04.*radar raised ValueError"):
        list((sf.Pipeline(radar_shards, backend="portable", **OPTS)
              .fields(png=sf.fields.Image(size=16), rdr=sf.fields.Decoder(radar))
              .batch(4).to("cpu")).loader())


def test_hf_tokens_match_the_tokenizers_library(laion, tmp_path):
    tokenizers = import_or_skip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([caption(n) for n in range(SAMPLES)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[SEP]", "[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    pad = tok.token_to_id("[PAD]")
    pipe = (sf.Pipeline(laion, on_error="skip", backend="portable", **OPTS)
            .fields(jpg=sf.fields.Image(size=16),
                    txt=sf.fields.Tokens(tmp_path / "tokenizer.json", length=6))
            .batch(8).to("cpu"))
    with pipe.loader() as loader:
        for batch in loader:
            for key, row in zip(batch.keys, batch["txt"].tolist(), strict=True):
                ids = tok.encode(caption(int(key))).ids[:6]
                assert row == ids + [pad] * (6 - len(ids))


def test_arrays_never_unpickled_and_shapes_stack_or_list(tmp_path):
    wds = import_or_skip("webdataset")
    with wds.TarWriter(str(tmp_path / "00000.tar")) as writer:
        for n in range(6):
            buf, arr = io.BytesIO(), io.BytesIO()
            Image.new("RGB", (20, 20)).save(buf, "PNG")
            value = np.array([{"x": 1}], dtype=object) if n == 2 else np.arange(n + 1.0)
            np.save(arr, value, allow_pickle=True)
            writer.write({"__key__": f"a{n}", "png": buf.getvalue(), "npy": arr.getvalue()})
    index_folder(tmp_path)
    pipe = (sf.Pipeline(tmp_path, on_error="skip", backend="portable", **OPTS)
            .fields(png=sf.fields.Image(size=8), npy=sf.fields.Array()).batch(6).to("cpu"))
    with pipe.loader() as loader:
        (batch,) = list(loader)
        assert loader.skip_counts() == {"bad-array": 1}
        assert "allow_pickle" in loader.skipped[0]["detail"]
    assert isinstance(batch["npy"], list)  # ragged: a list of arrays
    for key, value in zip(batch.keys, batch["npy"], strict=True):
        assert np.array_equal(value, np.arange(int(key[1:]) + 1.0))


def test_guarantees_refused_at_build_and_states_of_other_shapes(laion):
    def many(sample, rng):
        yield sample

    with pytest.raises(ValueError, match="map many: a generator"):
        captions(laion).map(many)
    rekey = captions(laion, backend="portable").map(lambda s, rng: {**s, "__key__": "x"})
    with rekey.loader() as loader, pytest.raises(ValueError, match="changed __key__"):
        next(iter(loader))
    with pytest.raises(ValueError, match="one sf.fields.Image field at most"):
        sf.Pipeline(laion).fields(a=sf.fields.Image(), b=sf.fields.Image())
    with image_loader(laion, batch_size=8, labels=False, size=24, device="cpu",
                      on_error="skip", backend="portable", **OPTS) as plain:
        saved = plain.state_dict()
    with captions(laion, backend="portable").loader() as loader:
        with pytest.raises(ValueError, match="saved by a 'image' loader, not a pipeline"):
            loader.load_state_dict(saved)
        state = loader.state_dict()
    other = captions(laion, backend="portable").filter(lambda s, rng: True)
    with other.loader() as loader, pytest.raises(ValueError, match="its steps differ"):
        loader.load_state_dict(state)


def test_map_draws_from_seed_epoch_key(laion):
    """A map's rng is the sample's own: the same draws on any backend, batch size or rank."""
    def tag(sample, rng):
        return {**sample, "json": {**sample["json"], "draw": rng.random()}}

    def draws(**options):  # type: ignore[no-untyped-def]
        pipe = captions(laion, **options).map(tag)
        with pipe.loader() as loader:
            return {k: j["draw"] for b in loader for k, j in zip(b.keys, b["json"], strict=True)}

    one = draws(backend="portable")
    assert draws(backend="portable", reader="stream") == one
    assert len(set(one.values())) == len(one)
    with captions(laion, backend="portable").map(tag).loader() as loader:
        loader.set_epoch(1)
        other = {k: j["draw"] for b in loader for k, j in zip(b.keys, b["json"], strict=True)}
    assert all(other[k] != one[k] for k in one)


@pytest.mark.backend
def test_describe_names_each_stage_and_where_it_runs(laion):
    """The automatic backend: DALI's graph where it imports, the portable threads elsewhere
    (the no-DALI pass of make test runs this too)."""
    from shardflow.loading.readers import dali_importable

    pipe = captions(laion).filter(lambda s, rng: True)
    with pipe.loader() as loader:
        stages = {s["stage"]: s["runs"] for s in loader.describe()}
        assert len([k for b in loader for k in b.keys]) == len(good_keys())
    assert stages["field jpg"] == ("the DALI graph (cpu)" if dali_importable()
                                   else "the portable backend's threads")
    assert stages["field txt"] == stages["filter <lambda>"] == "the reader stage's thread"
    assert stages["batch 8"] == "delivery to cpu"


@pytest.fixture(scope="module")
def depth_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Images whose red and green channels are ramps in x and y (4 levels a pixel, blue 255)
    and depth maps x + 2y as .npy: depth = R/4 + G/2 wherever the two moved alike."""
    wds = import_or_skip("webdataset")
    out = tmp_path_factory.mktemp("depth")
    ys, xs = np.mgrid[0:60, 0:56]
    with wds.TarWriter(str(out / "00000.tar")) as writer:
        for n in range(16):
            rgb = np.stack([xs * 4, ys * 4, np.full_like(xs, 255)], -1).astype(np.uint8)
            img, depth = io.BytesIO(), io.BytesIO()
            Image.fromarray(rgb).save(img, "PNG")
            np.save(depth, (xs + 2.0 * ys).astype(np.float32))
            writer.write({"__key__": f"d{n:02d}", "png": img.getvalue(),
                          "depth.npy": depth.getvalue()})
    index_folder(out)
    return out


@pytest.mark.parametrize("backend", ["dali", "portable"])
def test_depth_is_warped_with_its_image(depth_shards, backend):
    """After a random crop, flip and affine, each depth pixel equals the depth the image's
    own (moved) pixel stands for: bilinear against the image's nearest warp, within 3.5 depth
    units (half an output pixel at the steepest gradient) and 1.0 at the median."""
    import torch.nn.functional as F

    augment = [sf.ops.Flip(), sf.ops.Affine(degrees=25, translate=(0.1, 0.1),
                                            scale=(0.8, 1.2))]
    pipe = (sf.Pipeline(depth_shards, seed=1, backend=backend, **OPTS)
            .fields(png=sf.fields.Image(size=32, train=True, crop_scale=(0.3, 1.0),
                                        augment=augment, interp="linear"),
                    depth=sf.fields.Depth(member="depth.npy"))
            .batch(8).to("cpu"))
    with pipe.loader() as loader:
        batches = list(loader)
    assert sum(len(b) for b in batches) == 16
    for batch in batches:
        image, depth = batch["png"].float(), batch["depth"]
        assert depth.dtype == torch.float32 and depth.shape == (len(batch), 32, 32)
        want = image[:, 0] / 4 + image[:, 1] / 2
        # pixels inside the warped image, away from its edge and the frame's (there bilinear
        # blends in the zeros outside): blue is 255 in the whole 3x3 neighbourhood
        outside = F.pad((image[:, 2:3] < 255).float(), (1, 1, 1, 1), value=1.0)
        inside = F.max_pool2d(outside, 3, 1)[:, 0] == 0
        error = (depth - want).abs()[inside]
        assert inside.float().mean() > 0.3
        assert error.max() < 3.5 and error.median() < 1.0, (error.max(), error.median())
        assert (depth[~inside.bool()] >= 0).all()


def test_one_cutter_for_packing_and_row_windows_every_item_once_across_a_restart():
    """loading/cutting.Cutter (under text packing and tabular windows): reads of uneven
    lengths cut into batches of 5; after any batch, re-reading from its position and dropping
    its offset gives exactly the items not yet handed out."""
    from dataclasses import dataclass, field

    from shardflow.loading.cutting import Cutter

    @dataclass
    class Items:
        before: dict | None
        items: list[int]
        skips: list[dict] = field(default_factory=list)
        offset: int = 0
        reported: bool = False

        @property
        def left(self) -> int:
            return len(self.items) - self.offset

    lengths = [3, 0, 7, 1, 12, 4]
    reads = [list(range(sum(lengths[:i]), sum(lengths[:i + 1]))) for i in range(len(lengths))]

    def run(start: int, drop: int):  # type: ignore[no-untyped-def]
        cutter: Cutter[Items] = Cutter(5)
        out, positions = [], []
        for i in range(start, len(reads)):
            read = Items({"read": i}, reads[i], skips=[{"read": i}] if i == 4 else [])
            if i == start and drop:
                read.offset, read.reported = drop, True
            cutter.add(read, {"read": i + 1})
            while cutter.ready() or (i == len(reads) - 1 and cutter.available):
                spans, skips = cutter.take()
                out.append([x for r, lo, hi in spans for x in r.items[lo:hi]])
                positions.append(cutter.position())
        return out, positions

    whole, positions = run(0, 0)
    assert [x for batch in whole for x in batch] == list(range(sum(lengths)))
    assert all(len(b) == 5 for b in whole[:-1])
    for k in range(1, len(whole)):
        before, offset = positions[k - 1]
        rest, _ = run(before["read"], offset)
        assert [x for b in whole[:k] for x in b] + [x for b in rest for x in b] == \
            list(range(sum(lengths))), k


def test_a_pipeline_without_an_image_resumes_and_splits_over_ranks(laion):
    """Captions and JSON alone (fieldloader.py): the image is not read, so only the bad
    caption and the bad JSON are skips; a state saved mid-epoch on 2 ranks, through JSON,
    continues on 1 with every other sample exactly once, tokens as the captions' bytes."""
    pipe = (sf.Pipeline(laion, seed=2, on_error="skip", **OPTS)
            .fields(txt=sf.fields.Tokens("bytes", length=40), json=sf.fields.Json())
            .batch(4).to("cpu"))
    seen, state, _ = two_ranks_one_batch_each(pipe)
    with pipe.loader() as one:
        one.load_state_dict(state)
        rest = list(one)
        assert one.skip_counts() == {"bad-json": 1, "bad-utf8": 1}
    seen += [k for b in rest for k in b.keys]
    assert sorted(seen) == sorted(f"{n:09d}" for n in range(SAMPLES) if n not in (5, 17))
    for batch in rest:
        assert set(batch.fields) == {"txt", "json"}
        for key, row in zip(batch.keys, batch["txt"].tolist(), strict=True):
            text = caption(int(key)).encode()
            assert row == list(text[:40]) + [256] * (40 - len(text))
    with pytest.raises(ValueError, match="warp with an image"):
        sf.Pipeline(laion).fields(depth=sf.fields.Depth(), txt=sf.fields.Text())


def test_labels_partials_emptied_epochs_and_shared_members(radar_shards, laion,
                                                            depth_shards):
    """The label column beside an image is in every sample a step sees (and a map may not
    change it); without an image `cls` is a decoded field; a partial's stage name is the
    same in every process; an epoch a filter empties is no error; a member read twice is
    refused."""
    import functools

    def keep(sample, rng, label):  # type: ignore[no-untyped-def]
        return sample["cls"] == label

    pipe = (sf.Pipeline(radar_shards, on_error="skip", backend="portable", **OPTS)
            .fields(png=sf.fields.Image(size=16), rdr=sf.fields.Decoder(radar),
                    cls=sf.fields.Int(num_classes=3))
            .filter(functools.partial(keep, label=1)).batch(4).to("cpu"))
    with pipe.loader() as loader:
        labels = [int(v) for b in loader for v in b["cls"]]
        assert loader.filtered_counts() == {"filter partial(keep)": 8}  # 11 good: 1, 7, 10 kept
    assert labels == [1, 1, 1]
    with (sf.Pipeline(radar_shards, on_error="skip", **OPTS)
          .fields(cls=sf.fields.Int(), rdr=sf.fields.Decoder(radar)).batch(6)
          .to("cpu")).loader() as alone:
        rows = {k: int(c) for b in alone for k, c in zip(b.keys, b["cls"], strict=True)}
    assert rows == {f"s{n:02d}": n % 3 for n in range(12) if n != 4}
    nothing = captions(laion, backend="portable").filter(lambda s, rng: False)
    with nothing.loader() as loader, pytest.raises(DataError, match=(
            r"skipped: 1 bad-image, 1 bad-json, 1 bad-utf8 \(and 33 left out by filters\)")):
        list(loader)  # the bad ones are all that is left: that is still named
    nothing = (sf.Pipeline(depth_shards, backend="portable", **OPTS)
               .fields(png=sf.fields.Image(size=8)).filter(lambda s, rng: False).batch(4))
    with nothing.loader() as loader:  # no bad sample: an epoch the filter empties is no error
        assert sum(len(b) for b in loader) == 0
        assert loader.filtered_counts() == {"filter <lambda>": 16}
    with pytest.raises(ValueError, match="fields txt and caption both read .txt"):
        (sf.Pipeline(laion).fields(txt=sf.fields.Tokens(), caption=sf.fields.Text(member="txt"))
         .batch(2).loader())
