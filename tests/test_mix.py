"""Mixing datasets by weight (pipeline/loading/mix.py): per sample, stratified and per batch;
draws by weight from the seed alone, per-source counts, an epoch of a given number of batches,
exact resume, elastic resume on another number of ranks, bad mixtures refused."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, make_image_folder

from shardflow import image_loader, merge_states, pointcloud_loader, text_loader
from shardflow.builtin import make_pointcloud_folder, make_text_corpus
from shardflow.convert import ConvertConfig, convert

OPTS = {"batch_size": 4, "size": 16, "device": "cpu", "threads": 1, "use_tuning": False}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two image datasets: a (24 images, 6 shards) and b (16 images, 4 shards)."""
    root = tmp_path_factory.mktemp("mix")
    out = []
    for name, per_class in (("a", 12), ("b", 8)):
        src = make_image_folder(root / f"src-{name}", classes=2, per_class=per_class)
        for folder in sorted(src.iterdir()):  # keys that tell the sources apart: a0_img003
            folder.rename(src / folder.name.replace("class", name))
        convert(ConvertConfig(kind="imagefolder", src=str(src), out=root / name, max_count=4,
                              workers=1))
        out.append(root / name)
    return out[0], out[1]


def _source_of(batch_keys: list[str], a_keys: set[str]) -> str:
    return "a" if batch_keys[0] in a_keys else "b"


def _keys(folder: Path) -> set[str]:
    with image_loader(folder, **OPTS) as loader:
        return {k for batch in loader for k in batch.keys}


def _source_sequence(folder: Path, n: int, seed: int) -> list[str]:
    """The first n keys a loader of `folder` alone gives, epoch after epoch."""
    out: list[str] = []
    with image_loader(folder, seed=seed, **OPTS) as loader:
        while len(out) < n:
            out += [k for batch in loader for k in batch.keys]
    return out[:n]


def test_per_sample_places_follow_the_weights_and_every_source_keeps_its_order(sources):
    a, b = sources
    a_keys = _keys(a)
    with image_loader([(a, 0.7), (b, 0.3)], seed=5, epoch_batches=40, **OPTS) as mixed:
        assert mixed.mixing == "sample" and len(mixed) == 40
        batches = list(mixed)
        counts = mixed.last_counts
    assert all(len(batch) == 4 for batch in batches)
    # Each batch holds as many rows of each source as its seeded draws name...
    for i, batch in enumerate(batches):
        from_a = sum(k in a_keys for k in batch.keys)
        assert [from_a, 4 - from_a] == mixed.places_of(i, epoch=0)
        assert batch.keys == sorted(batch.keys, key=lambda k: k not in a_keys)  # a's first
        assert batch.image.shape == (4, 3, 16, 16) and batch.label.shape == (4,)
    # ...and over the epoch a's share is within 3 standard errors of 0.7 (0.109 over 160
    # places); a mixture per batch of these sizes swings far wider.
    share = counts[str(a)] / 160
    assert abs(share - 0.7) < 3 * math.sqrt(0.7 * 0.3 / 160)
    assert counts[str(b)] == 160 - counts[str(a)]
    draws = [mixed.places_of(i, epoch=e)[0] for e in range(20) for i in range(40)]
    assert sum(draws) / (4 * len(draws)) == pytest.approx(0.7, abs=0.01)  # 3,200 places: 4 sd
    # Rows of a source come in its own loader's order, each once an epoch, none lost between
    # batches: its epochs run on (a's third begins) and are reshuffled.
    for folder in (a, b):
        taken = [k for batch in batches for k in batch.keys if (k in a_keys) == (folder == a)]
        assert taken == _source_sequence(folder, len(taken), seed=5)
    assert len([k for batch in batches for k in batch.keys if k not in a_keys]) > 16


def test_stratified_batches_hold_the_shares_rounded_and_the_epoch_holds_them(sources):
    a, b = sources
    a_keys = _keys(a)
    with image_loader([(a, 0.7), (b, 0.3)], seed=5, epoch_batches=40, mixing="stratified",
                      **OPTS) as mixed:
        for _ in range(2):
            per_batch = [sum(k in a_keys for k in batch.keys) for batch in mixed]
            # 0.7 of 4 places is 2.8: every batch 2 or 3 of a, the rounding carried so that
            # after each batch a is within a place of 0.7 of the places so far
            assert set(per_batch) == {2, 3}
            assert all(abs(sum(per_batch[:i + 1]) - 2.8 * (i + 1)) < 1 for i in range(40))
            assert mixed.last_counts == {str(a): 112, str(b): 48}


def test_per_sample_resume_is_exact_to_the_pixel(sources):
    a, b = sources
    make = functools.partial(image_loader, [(a, 0.6), (b, 0.4)], seed=3, **OPTS)
    with make() as whole:
        assert len(whole) == 10
        batches = [(batch.keys, batch.image.clone()) for _ in range(2) for batch in whole]
    for stop in (3, 7):  # 7: mid-source-batch places are carried over, and a's epoch rolls
        with make() as first:
            it = iter(first)
            seen = [(batch.keys, batch.image.clone()) for batch in
                    (next(it) for _ in range(stop))]
            state = json.loads(json.dumps(first.state_dict()))
        assert any(part["taken"] % 4 for part in state["ranks"][0]["sources"])
        with make() as resumed:
            resumed.load_state_dict(state)
            rest = [(batch.keys, batch.image) for _ in range(2) for batch in resumed]
        got = seen + rest[:len(batches) - stop]
        assert [k for k, _ in got] == [k for k, _ in batches]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got, batches, strict=True))


def test_a_mixture_saved_after_its_epochs_last_batch_resumes_with_the_next_epoch(sources):
    """A state taken inside the loop after the epoch's last batch (a trainer checkpointing
    every step) said batch 10 of 10: the resumed mixture's first pass was empty, and every
    later epoch one pass late. Now that pass is epoch 1, as a plain loader's is."""
    a, b = sources
    make = functools.partial(image_loader, [(a, 0.6), (b, 0.4)], seed=3, **OPTS)
    with make() as whole:
        epochs = [[batch.keys for batch in whole] for _ in range(3)]
    with make() as first:
        for _ in first:
            state = json.loads(json.dumps(first.state_dict()))
    assert (state["epoch"], state["batches"]) == (0, 10)
    with make() as resumed:
        resumed.load_state_dict(state)
        assert [[batch.keys for batch in resumed] for _ in range(2)] == epochs[1:]
        assert resumed.epoch == 3


@pytest.mark.parametrize("mixing", ["sample", "stratified", "batch"])
def test_a_mixture_saved_on_two_ranks_resumes_on_one_with_each_sample_once(sources, mixing):
    a, b = sources
    everything = {"a": _keys(a), "b": _keys(b)}
    make = functools.partial(image_loader, [(a, 0.6), (b, 0.4)], seed=2, mixing=mixing,
                             epoch_batches=20, **OPTS)
    before, states = [], []
    for rank in (0, 1):
        with make(rank=rank, world_size=2) as loader:
            it = iter(loader)
            before += [k for _ in range(2) for k in next(it).keys]  # within epoch 0
            states.append(json.loads(json.dumps(loader.state_dict(gather=False))))
    assert len(before) == len(set(before))
    with make(world_size=1, rank=0) as resumed:
        resumed.load_state_dict(merge_states(states))
        after = [k for batch in resumed for k in batch.keys]
    for name, keys in everything.items():
        seen = [k for k in before if k in keys]
        rest = [k for k in after if k in keys][:len(keys) - len(seen)]
        # the rest of each source's epoch is every sample no rank had, each once
        assert sorted(rest) == sorted(keys - set(seen)), name


def test_batches_follow_the_weights_from_the_seed_alone(sources):
    a, b = sources
    a_keys = _keys(a)
    make = functools.partial(image_loader, [(a, 3.0), (b, 1.0)], seed=5, epoch_batches=40,
                             mixing="batch", **OPTS)
    with make() as mixed:
        assert len(mixed) == 40 and mixed.weights == [0.75, 0.25]
        order = [_source_of(batch.keys, a_keys) for batch in mixed]
        counts = mixed.last_counts
    # The batches come from the sources the seeded draws name, one draw a batch...
    assert order == ["ab"[mixed.source_of(i, epoch=0)] for i in range(40)]
    # ...and the draws hold the weights: over 20,000 of them a's share is 0.75 within 5 sd
    # (0.015); a 2:1 bug (0.667) or weights read backwards (0.25) is far outside.
    draws = [mixed.source_of(i, epoch=e) for e in range(50) for i in range(400)]
    assert draws.count(0) / len(draws) == pytest.approx(0.75, abs=0.015)
    assert counts == {str(a): 4 * order.count("a"), str(b): 4 * order.count("b")}
    # each source cycles through its own epochs: b (4 batches an epoch) ran out and went on
    assert order.count("b") > 4
    with make() as again:
        assert [_source_of(batch.keys, a_keys) for batch in again] == order
        assert [_source_of(batch.keys, a_keys) for batch in again] != order  # epoch 1 differs
    with image_loader([(a, 3.0), (b, 1.0)], seed=6, epoch_batches=40, mixing="batch",
                      **OPTS) as other:
        assert [_source_of(batch.keys, a_keys) for batch in other] != order


def test_a_default_epoch_is_the_sources_epochs_together_and_resume_is_exact(sources):
    a, b = sources
    make = functools.partial(image_loader, [(a, 0.5), (b, 0.5)], seed=1, mixing="batch",
                             **OPTS)
    with make() as whole:
        assert len(whole) == 6 + 4  # the sources' batches per epoch, together
        batches = [batch.keys for _ in range(2) for batch in whole]
    with make() as first:
        it = iter(first)
        seen = [next(it).keys for _ in range(7)]
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    with make() as resumed:
        resumed.load_state_dict(state)
        rest = [batch.keys for batch in resumed] + [batch.keys for batch in resumed]
    assert seen + rest == batches


def test_a_state_saved_before_mixing_per_sample_resumes_whole_batches(sources):
    a, b = sources
    make = functools.partial(image_loader, [(a, 0.5), (b, 0.5)], seed=1, mixing="batch",
                             **OPTS)
    with make() as whole:
        batches = [batch.keys for batch in whole]
    with make() as first:
        it = iter(first)
        seen = [next(it).keys for _ in range(4)]
        new = first.state_dict()
        # as the version before wrote it: no "mixing", each source's own whole state
        old = {k: new[k] for k in ("kind", "epoch", "batches", "seed", "names", "weights",
                                   "epoch_batches")}
        old["counts"] = new["ranks"][0]["counts"]
        old["sources"] = [loader.state_dict() for loader in first.loaders]
    with make() as resumed:
        resumed.load_state_dict(json.loads(json.dumps(old)))
        assert seen + [batch.keys for batch in resumed] == batches
    with image_loader([(a, 0.5), (b, 0.5)], seed=1, **OPTS) as per_sample, \
            pytest.raises(ValueError, match="mixing: 'batch' in the state, 'sample' here"):
        per_sample.load_state_dict(old)


def test_stratified_resume_is_exact(sources):
    a, b = sources
    make = functools.partial(image_loader, [(a, 0.7), (b, 0.3)], seed=8, mixing="stratified",
                             epoch_batches=15, **OPTS)
    with make() as whole:
        batches = [batch.keys for batch in whole]
    with make() as first:
        it = iter(first)
        seen = [next(it).keys for _ in range(6)]
        state = json.loads(json.dumps(first.state_dict()))
    assert state["given"] != [0, 0]
    with make() as resumed:
        resumed.load_state_dict(state)
        assert seen + [batch.keys for batch in resumed] == batches


def test_text_sources_mix_too_and_packed_text_needs_an_epoch_length(tmp_path):
    shards = []
    for name in ("x", "y"):
        docs = make_text_corpus(tmp_path / f"docs-{name}", docs=40)
        convert(ConvertConfig(kind="text", src=str(docs), out=tmp_path / name, max_count=20,
                              workers=1))
        shards.append(tmp_path / name)
    mixture = [(shards[0], 1), (shards[1], 1)]
    with pytest.raises(ValueError, match="epoch_batches"):
        text_loader(mixture, batch_size=4, seq_len=32, device="cpu", use_tuning=False)
    with text_loader(mixture, batch_size=4, seq_len=32, device="cpu", use_tuning=False,
                     epoch_batches=12) as mixed:
        batches = list(mixed)
    assert len(batches) == 12 and all(b.input_ids.shape == (4, 32) for b in batches)
    assert sum(mixed.last_counts.values()) == 12 * 4
    # Per sample, a text batch is rows of both sources' batches, and a resume from any batch
    # gives the same rows and keys (a source batch's documents come with its first row).
    make = functools.partial(text_loader, mixture, batch_size=4, seq_len=32, device="cpu",
                             use_tuning=False, epoch_batches=12, seed=4)
    with make() as whole:
        batches = list(whole)
    rows, keys = [batch.input_ids for batch in batches], [batch.keys for batch in batches]
    for stop in (2, 5):
        with make() as first:
            it = iter(first)
            seen = [next(it) for _ in range(stop)]
            state = json.loads(json.dumps(first.state_dict()))
        with make() as resumed:
            resumed.load_state_dict(state)
            got = seen + list(resumed)
        assert [batch.keys for batch in got] == keys
        assert all(torch.equal(b.input_ids, y) for b, y in zip(got, rows, strict=True))


def test_point_clouds_mix_per_sample(tmp_path):
    shards = []
    for name, per_class in (("p", 4), ("q", 2)):
        src = make_pointcloud_folder(tmp_path / f"src-{name}", per_class=per_class)
        convert(ConvertConfig(kind="pointcloud", src=str(src), out=tmp_path / name,
                              max_count=8, workers=1))
        shards.append(tmp_path / name)
    with pointcloud_loader([(shards[0], 2.0), (shards[1], 1.0)], batch_size=4, num_points=64,
                           voxels="occupancy", grid=8, device="cpu", use_tuning=False, seed=1,
                           epoch_batches=6) as mixed:
        batches = list(mixed)
    for b in batches:
        assert b.points.shape == (4, 64, b.points.shape[2]) and b.label.shape == (4,)
        assert b.offset.shape == (4, 3) and b.voxels.shape == (4, 1, 8, 8, 8)
    assert sum(mixed.last_counts.values()) == 24 and min(mixed.last_counts.values()) > 0


def test_rows_of_other_shapes_are_refused_naming_the_batch_mode():
    from shardflow.loading import rows
    from shardflow.loading.batch import ImageBatch

    small = ImageBatch(image=torch.zeros(2, 3, 8, 8), label=torch.zeros(2), keys=["x", "y"])
    large = ImageBatch(image=torch.zeros(1, 3, 9, 9), label=torch.zeros(1), keys=["z"])
    assert rows.join([small, rows.take(small, 1, 2)]).keys == ["x", "y", "y"]
    with pytest.raises(ValueError, match="mixing='batch'"):
        rows.join([small, large])
    np.testing.assert_array_equal(rows.pick(small, [1]).label.numpy(), [0])


@pytest.mark.parametrize("mixture, match", [
    (lambda a, b: [(a, 0.0), (b, 1.0)], "above 0"),
    (lambda a, b: [(a, float("nan")), (b, 1.0)], "above 0"),
    (lambda a, b: [(a, 1.0), (a, 1.0)], "twice"),
    (lambda a, b: {"source": [(a, 1.0), (b, 1.0)], "mixing": "per-row"}, "mixing='per-row'"),
])
def test_bad_mixtures_are_refused(sources, mixture, match):
    mixture = mixture(*sources)
    options = {**OPTS, **(mixture if isinstance(mixture, dict) else {"source": mixture})}
    with pytest.raises(ValueError, match=match):
        image_loader(options.pop("source"), **options)


def test_a_state_of_another_mixture_is_refused(sources):
    a, b = sources
    with image_loader([(a, 1.0), (b, 1.0)], seed=1, **OPTS) as mixed:
        state = mixed.state_dict()
    with image_loader([(a, 1.0), (b, 3.0)], seed=1, **OPTS) as other, \
            pytest.raises(ValueError, match="weights"):
        other.load_state_dict(state)


@pytest.mark.slow
def test_a_packed_text_mixture_on_two_gloo_ranks_gathers_its_state_and_resumes(tmp_path):
    shards = []
    # A rank's epoch of x is about 8 batches of 4 rows and of y about 4: 20 batches of the
    # mixture (0.7/0.3) take 14 of x and 6 of y, past the end of both.
    for name, docs in (("x", 4), ("y", 2)):
        made = make_text_corpus(tmp_path / f"docs-{name}", docs=docs)
        convert(ConvertConfig(kind="text", src=str(made), out=tmp_path / name,
                              max_count=docs // 2, workers=1))
        shards.append(str(tmp_path / name))
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tests" / "mix_ranks.py"), *shards, "3", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    # one whole state, the same on both ranks, with each rank's place in each source
    assert ranks[0]["state"] == ranks[1]["state"]
    assert len(ranks[0]["state"]["ranks"]) == 2 and ranks[0]["state"]["batches"] == 3
    for rank in ranks:
        assert len(rank["first"]) == 3 and len(rank["rest"]) == 17
        assert rank["again"] == rank["rest"]  # resumed on the same ranks: the same rows
        assert sum(rank["counts"].values()) > 0
    assert ranks[0]["first"] != ranks[1]["first"]  # each rank reads its own shards


def test_bad_samples_in_a_source_are_counted_and_the_rest_read_once(sources, tmp_path):
    """Per sample, a source batch with skips leaves its places empty: the mixture's batch is
    shorter, the skips are reported with the shard and key, and every good sample of the
    source's epoch comes out once."""
    from conftest import jpeg_bytes

    from shardflow.shards.manifest import Manifest
    from shardflow.shards.writer import ShardWriter

    a, _ = sources
    bad = tmp_path / "bad"
    bad.mkdir()
    writer = ShardWriter(bad, "train", max_count=100, max_size=10**8)
    for i in range(12):
        data = jpeg_bytes(i, size=(20, 20))
        writer.write({"__key__": f"c{i:02d}", "jpg": data[: len(data) // 3] if i in (3, 8)
                      else data, "cls": b"0"})
    info = writer.finish()
    assert info is not None
    Manifest([info], "image", {"x": 0, "y": 1}).save(bad / "manifest.json")
    with image_loader([(a, 1.0), (bad, 1.0)], seed=3, epoch_batches=6, on_error="skip",
                      **OPTS) as mixed:
        batches = list(mixed)
        skips = mixed.skip_counts()
        skipped = mixed.skipped
    from_bad = [k for b in batches for k in b.keys if k.startswith("c")]
    taken = sum(mixed.places_of(i, epoch=0)[1] for i in range(6))
    assert taken >= 12  # the bad source's whole epoch was drawn
    assert sorted(from_bad[:10]) == [f"c{i:02d}" for i in range(12) if i not in (3, 8)]
    assert sum(skips.values()) >= 2 and {e["key"] for e in skipped} >= {"c03", "c08"}
    assert any(len(b) < 4 for b in batches)  # the places of the bad samples stay empty
    assert sum(len(b) for b in batches) == sum(mixed.last_counts.values())
