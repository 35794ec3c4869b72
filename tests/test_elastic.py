"""Elastic resume: a state saved on N ranks continues on M, every sample of the epoch read
once; the same state resumes on every rank at the same N (pipeline/loading/elastic.py).

In-process ranks here (rank/world_size given, states joined with merge_states); the gloo runs
under torchrun, with kills, are in test_elastic_runs.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import run_tool

from shardflow import image_loader, merge_states, text_loader
from shardflow.builtin import make_image_folder, make_text_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.text.tokenizer import ByteTokenizer

OPTS = {"device": "cpu", "shuffle_buffer": 20, "prefetch": 2}
TEXT = {"device": "cpu", "shuffle_buffer": 8, "prefetch": 2, "seq_len": 32,
        "objective": "clm"}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """90 images (10 classes), 9 shards of 10, classes spread over shards."""
    root = tmp_path_factory.mktemp("elastic-img")
    src = make_image_folder(root / "src", per_class=9, size=16)
    run_tool("make_shards", "imagefolder", src, root / "out", "--max-count", 10,
             "--shuffle-seed", 0, check=True)
    return root / "out"


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("elastic-text")
    docs = make_text_corpus(root / "docs", docs=96)
    convert(ConvertConfig(kind="text", src=str(docs), out=root / "shards", max_count=12,
                          workers=1))
    return root / "shards", {p.stem: p.read_text(encoding="utf-8") for p in docs.iterdir()}


def _take(loader, n: int) -> list:
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    it.close()
    return out


def _keys(batches: list) -> list[str]:
    return [k for b in batches for k in b.keys]


def _images(world: int, rank: int, shards: Path, **kw):
    return image_loader(shards, batch_size=8, rank=rank, world_size=world, **{**OPTS, **kw})


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_two_ranks_to_one_reads_the_rest_of_the_epoch_once(images, reader):
    before, states = [], []
    for rank in range(2):
        with _images(2, rank, images, reader=reader) as loader:
            before += _keys(_take(loader, 2))
            states.append(loader.state_dict(gather=False))
    state = merge_states(states[::-1])  # in any order
    with _images(1, 0, images, reader=reader) as one:
        one.load_state_dict(state)
        rest = _keys(list(one))
        assert one.epoch == 1
        # the next epoch is whole again, as a loader that never stopped reads it
        nxt = _keys(list(one))
    everything = before + rest
    assert len(everything) == len(set(everything)) == 90  # none twice, none lost
    with _images(1, 0, images, reader=reader) as fresh:
        fresh.set_epoch(1)
        assert nxt == _keys(list(fresh))


def test_one_rank_to_two_splits_the_rest_over_both(images, caplog):
    with _images(1, 0, images) as one:
        before = _keys(_take(one, 3))
        state = one.state_dict()
    assert state["ranks"] and "rank" not in state  # one rank: already whole
    rests, dropped = [], 0
    for rank in range(2):
        with _images(2, rank, images) as loader:
            loader.load_state_dict(state)
            plan = loader.plan()
            dropped = plan.dropped
            rests.append(_keys(list(loader)))
            assert loader.epoch == 1
    assert len(rests[0]) == len(rests[1])  # ranks step together
    everything = before + rests[0] + rests[1]
    assert len(everything) == len(set(everything))
    assert len(everything) + dropped == 90  # what the even split leaves out is reported
    assert dropped and f"{dropped} samples are left out this epoch" in caplog.text


def test_little_left_every_rank_reads_it_and_keeps_its_share(images):
    with _images(1, 0, images) as one:
        before = _keys(_take(one, 10))  # 80 of 90 read: a few shards left, some in part
        state = one.state_dict()
    rests, plans = [], []
    for rank in range(5):
        with _images(5, rank, images) as loader:
            loader.load_state_dict(state)
            plans.append(loader.plan())
            rests.append(_keys(list(loader)))
    assert all(p.stride for p in plans)
    assert len({len(r) for r in rests}) == 1  # every rank the same length
    everything = before + [k for r in rests for k in r]
    assert len(everything) == len(set(everything))
    assert len(everything) + plans[0].dropped == 90


def test_every_rank_resumes_from_one_whole_state_at_the_same_world_size(images):
    states, full = [], []
    for rank in range(2):
        with _images(2, rank, images) as loader:
            full.append(_keys(list(loader)))
        with _images(2, rank, images) as loader:
            _take(loader, 2)
            states.append(loader.state_dict(gather=False))
    whole = merge_states(states)
    for rank in range(2):
        with _images(2, rank, images) as loader:
            loader.load_state_dict(whole)
            assert _keys(list(loader)) == full[rank][16:]  # exactly where that rank stood


def test_rest_twice_resumed_on_other_world_sizes(images):
    """2 ranks -> 3 -> 1 within one epoch: what each world read adds up, once."""
    seen, states = [], []
    for rank in range(2):
        with _images(2, rank, images) as loader:
            seen += _keys(_take(loader, 1))
            states.append(loader.state_dict(gather=False))
    whole, states = merge_states(states), []
    for rank in range(3):
        with _images(3, rank, images) as loader:
            loader.load_state_dict(whole)
            seen += _keys(_take(loader, 1))
            states.append(loader.state_dict(gather=False))
    with _images(1, 0, images) as one:
        one.load_state_dict(merge_states(states))
        seen += _keys(list(one))
    assert len(seen) == len(set(seen)) == 90


def test_a_rank_state_of_other_shards_or_settings_is_refused(images):
    with _images(1, 0, images) as one:
        _take(one, 1)
        state = one.state_dict()
    with _images(2, 1, images, shuffle_buffer=4) as other:
        with pytest.raises(ValueError, match="shuffle_buffer"):
            other.load_state_dict(state)
    with _images(2, 0, images) as lone, \
            pytest.raises(ValueError, match="one state of each of ranks"):
        merge_states([lone.state_dict(gather=False)])


def _tokens(batches: list) -> Counter:
    return Counter(torch.cat([b.input_ids[b.attention_mask == 1] for b in batches]).tolist())


def _expected_tokens(docs: dict[str, str], leave_out: set[str] = frozenset()) -> Counter:
    out: Counter = Counter()
    for key, text in docs.items():
        if key not in leave_out:
            out.update(text.encode("utf-8"))
            out[ByteTokenizer.sep_id] += 1
    return out


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_packed_text_two_ranks_to_one_every_token_once(texts, reader):
    shards, docs = texts
    first, states = [], []
    for rank in range(2):
        with text_loader(shards, batch_size=3, rank=rank, world_size=2, reader=reader,
                         **TEXT) as loader:
            first += _take(loader, 5)  # documents cut between batches, mid-read
            states.append(loader.state_dict(gather=False))
    with text_loader(shards, batch_size=3, reader=reader, **TEXT) as one:
        one.load_state_dict(merge_states(states))
        rest = list(one)
    assert _tokens(first + rest) == _expected_tokens(docs)
    assert set(_keys(first + rest)) == set(docs)


def test_packed_text_one_rank_to_two_every_token_once(texts):
    shards, docs = texts
    with text_loader(shards, batch_size=3, **TEXT) as one:
        first = _take(one, 7)
        state = one.state_dict()
    rests, dropped = [], 0
    for rank in range(2):  # no process group: each rank reads all of its rest
        with text_loader(shards, batch_size=3, rank=rank, world_size=2, **TEXT) as loader:
            loader.load_state_dict(state)
            dropped = loader.plan().dropped  # documents the even split leaves out
            rests += list(loader)
    left_out = set(docs) - set(_keys(first + rests))
    assert len(left_out) == dropped
    assert _tokens(first + rests) == _expected_tokens(docs, left_out)


def test_packed_text_saved_at_its_epochs_end_resumes_on_other_ranks_into_the_next(texts):
    """A state taken after the epoch's last batch (a trainer checkpointing every step),
    resumed on 2 ranks: the rest is empty, so that pass is the next epoch, as on 1 rank.
    Each rank's pass was empty (nothing trained that epoch)."""
    shards, docs = texts
    with text_loader(shards, batch_size=3, **TEXT) as one:
        for _ in one:
            state = one.state_dict()
    for rank in range(2):
        with text_loader(shards, batch_size=3, rank=rank, world_size=2, **TEXT) as loader:
            loader.load_state_dict(state)
            batches = list(loader)
            assert batches and loader.epoch == 2  # epoch 1 read whole on this rank count
            with text_loader(shards, batch_size=3, rank=rank, world_size=2, **TEXT) as fresh:
                fresh.set_epoch(1)
                assert _keys(batches) == _keys(list(fresh))


def test_an_evaluation_loader_resumed_on_other_ranks_then_reads_whole_passes(images):
    """train=False: a pass starts at the epoch's beginning. After an elastic resume (the
    first pass continues the rest, here cut short: a sanity check), the next passes read
    all of it, not the rest again."""
    states = []
    for rank in range(2):
        with _images(2, rank, images, train=False) as loader:
            _take(loader, 2)
            states.append(loader.state_dict(gather=False))
    with _images(1, 0, images, train=False) as whole:
        everything = _keys(list(whole))
    with _images(1, 0, images, train=False) as one:
        one.load_state_dict(merge_states(states))
        assert len(_keys(_take(one, 1))) == 8  # of the rest
        assert _keys(list(one)) == _keys(list(one)) == everything


def test_a_state_is_refused_by_a_loader_holding_out_other_keys(images):
    """The holdout decides which samples are read: a state saved with one is refused by a
    loader without it, or with another side or share (a state without the field, saved
    before it was recorded, is not checked)."""
    from shardflow.loading.holdout import KeyHoldout

    with _images(1, 0, images) as loader:
        loader.holdout = KeyHoldout("train", 10)
        _take(loader, 1)
        state = loader.state_dict()
    for other in (None, KeyHoldout("train", 50), KeyHoldout("eval", 10)):
        with _images(1, 0, images) as loader:
            loader.holdout = other
            with pytest.raises(ValueError, match="differs in holdout"):
                loader.load_state_dict(state)
    with _images(1, 0, images) as loader:
        loader.holdout = KeyHoldout("train", 10)
        loader.load_state_dict(state)
        loader.holdout = None
        loader.load_state_dict({k: v for k, v in state.items() if k != "holdout"})


def test_little_left_a_lost_shard_is_counted_once_over_the_ranks(images, tmp_path):
    """With fewer shards left than ranks, every rank reads them and keeps its share: a shard
    cut short among them was recorded by every rank (4 lost samples counted 8 times on 2
    ranks). Rank 0 records it: read + skipped is the epoch, on any world size."""
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(images, shards)
    opts = {"reader": "stream", "on_error": "skip", "shuffle_buffer": 0}
    with _images(1, 0, shards, **opts) as one:
        last = Path(one.plan().shards[-1].url)
        with open(last, "r+b") as f:
            f.truncate(last.stat().st_size // 2)
        before = _keys(_take(one, 10))  # 80 of 90 read: the last shard is left
        state = one.state_dict()
    for world in (2, 3):
        read, skipped = list(before), 0
        for rank in range(world):
            with _images(world, rank, shards, **opts) as loader:
                loader.load_state_dict(state)
                assert loader.plan().stride
                read += _keys(list(loader))
                skipped += loader.skipped_samples()
        assert len(read) == len(set(read)) and 0 < skipped < 10
        assert len(read) + skipped == 90, world
