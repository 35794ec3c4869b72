"""Subsets at load time (pipeline/loading/subset.py): subsample, keys (a file or a list, or
excluded), select on key and label; the same keys on 1 and 2 ranks, through an exact and an
elastic resume, on every reader; what is left out counted apart from bad data; a state
refused by a loader with another subset; the tabular loader refuses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import dali_available, resumed_run

from shardflow import image_loader, merge_states, pointcloud_loader, text_loader
from shardflow.builtin import make_image_folder, make_pointcloud_folder, make_text_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.loading.subset import _unit

IMAGE = {"batch_size": 6, "size": 24, "device": "cpu", "shuffle_buffer": 8, "seed": 4}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("subset")
    made = {"image": ("imagefolder", make_image_folder(root / "i", per_class=6, size=32)),
            "text": ("text", make_text_corpus(root / "t", docs=60)),
            "pointcloud": ("pointcloud", make_pointcloud_folder(root / "p", per_class=4,
                                                                points=64))}
    for name, (kind, src) in made.items():
        convert(ConvertConfig(kind=kind, src=str(src), out=root / name, max_count=8, workers=1))
    return {name: root / name for name in made}


def _keys(loader) -> list[str]:
    return [k for batch in loader for k in batch.keys]


def _all_keys(source: Path) -> set[str]:
    with image_loader(source, **{**IMAGE, "train": False}) as loader:
        return set(_keys(loader))


READERS = ["stream", pytest.param("dali", marks=pytest.mark.dali), "index"]


@pytest.mark.parametrize("reader", READERS)
def test_subsample_takes_the_keys_its_hash_picks_on_one_or_two_ranks(data, reader):
    every = _all_keys(data["image"])
    want = {k for k in every if _unit(4, k) < 0.4}
    assert 0 < len(want) < len(every)
    with image_loader(data["image"], reader=reader, subsample=0.4, **IMAGE) as loader:
        got = _keys(loader)
        assert set(got) == want and len(got) == len(want)
        assert loader.left_out == len(every) - len(want) and loader.skipped == []
    ranks = []
    for rank in range(2):
        with image_loader(data["image"], reader=reader, subsample=0.4, rank=rank,
                          world_size=2, **IMAGE) as loader:
            ranks.append(set(_keys(loader)))
    assert not ranks[0] & ranks[1] and ranks[0] | ranks[1] <= want
    # what two ranks leave out to even their lengths is left out of the subset too
    assert len(want - (ranks[0] | ranks[1])) <= len(every) // 2


@pytest.mark.parametrize("reader", READERS)
def test_a_subset_resumes_exactly(data, reader):
    def make():
        return image_loader(data["image"], reader=reader, subsample=0.5, **IMAGE)

    head, rest, again = resumed_run(make, after=3)
    assert [b.keys for b in again] == [b.keys for b in rest]
    taken = {k for b in head + rest for k in b.keys}
    assert taken == {k for k in _all_keys(data["image"]) if _unit(4, k) < 0.5}


def test_two_ranks_resumed_on_one_read_the_rest_of_the_subset_once(data):
    every = _all_keys(data["image"])
    want = {k for k in every if _unit(4, k) < 0.5}
    first, states = [], []
    for rank in range(2):
        with image_loader(data["image"], rank=rank, world_size=2, subsample=0.5,
                          reader="stream", **IMAGE) as loader:
            it = iter(loader)
            first += [k for _ in range(2) for k in next(it).keys]
            states.append(loader.state_dict(gather=False))
    with image_loader(data["image"], subsample=0.5, reader="stream", **IMAGE) as one:
        one.load_state_dict(json.loads(json.dumps(merge_states(states))))
        rest = _keys(one)
    assert not set(first) & set(rest) and len(first) + len(rest) == len(set(first + rest))
    assert set(first + rest) == want  # every taken sample once; the rank split left none out


def test_keys_from_a_file_or_excluded_on_packed_text(data, tmp_path):
    every = sorted(f"doc_{i:05d}" for i in range(60))
    chosen = every[::3]
    listing = tmp_path / "keys.txt"
    listing.write_text("# the documents to train on\n" + "\n".join(chosen) + "\n\n")
    common = {"batch_size": 2, "seq_len": 64, "device": "cpu", "train": False}
    with text_loader(data["text"], keys=listing, **common) as loader:
        got = set(_keys(loader))
        assert got == set(chosen) and loader.left_out == 40
    with text_loader(data["text"], keys=chosen, exclude=True, **common) as loader:
        assert set(_keys(loader)) == set(every) - set(chosen)


def test_select_on_the_label_of_point_clouds(data):
    common = {"batch_size": 4, "num_points": 32, "device": "cpu", "train": False}
    with pointcloud_loader(data["pointcloud"], **common) as loader:
        labels = {k: int(lab) for b in loader for k, lab in zip(b.keys, b.label, strict=True)}
    with pointcloud_loader(data["pointcloud"], select=lambda key, m: m["cls"] in (b"1", b"3"),
                           **common) as loader:
        got = {k: int(lab) for b in loader for k, lab in zip(b.keys, b.label, strict=True)}
    assert got == {k: v for k, v in labels.items() if v in (1, 3)} and got


def test_a_state_of_another_subset_is_refused_naming_it(data):
    with image_loader(data["image"], subsample=0.5, **IMAGE) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with image_loader(data["image"], subsample=0.25, **IMAGE) as other, \
            pytest.raises(ValueError, match="it differs in subset"):
        other.load_state_dict(state)
    with image_loader(data["image"], **IMAGE) as whole, \
            pytest.raises(ValueError, match="it differs in subset"):
        whole.load_state_dict(state)


def test_bad_subset_options_are_refused(data, tmp_path):
    with pytest.raises(ValueError, match=r"subsample=1.5: a fraction in \(0, 1\]"):
        image_loader(data["image"], subsample=1.5, **IMAGE)
    with pytest.raises(ValueError, match="exclude=True drops the samples named by keys"):
        image_loader(data["image"], exclude=True, **IMAGE)
    with pytest.raises(ValueError, match="keys: strings"):
        image_loader(data["image"], keys=[1, 2], **IMAGE)
    from shardflow import tabular_loader
    from shardflow.builtin import make_ctr_dataset
    from shardflow.convert.tabular import TabularOptions

    clicks = make_ctr_dataset(tmp_path / "clicks", rows=2000)
    convert(ConvertConfig(kind="tabular", src=str(clicks / "part-00000.tsv"),
                          out=tmp_path / "ctr", tabular=TabularOptions(preset="criteo"),
                          workers=1))
    with pytest.raises(ValueError, match="blocks of rows with no keys"):
        tabular_loader(tmp_path / "ctr", batch_size=64, subsample=0.5, device="cpu")


@pytest.mark.skipif(not dali_available(), reason="DALI is not installed")
def test_the_portable_backend_takes_the_same_subset(data):
    with image_loader(data["image"], subsample=0.3, backend="portable", **IMAGE) as a, \
            image_loader(data["image"], subsample=0.3, backend="dali", reader="stream",
                         **IMAGE) as b:
        assert set(_keys(a)) == set(_keys(b))


@pytest.mark.parametrize("reader, backend", [("index", "portable"), ("stream", "portable"),
                                             pytest.param("dali", "dali", marks=pytest.mark.dali)])
def test_a_subset_killed_mid_epoch_resumes_with_the_same_batches(op_shards, tmp_path, reader,
                                                                 backend):
    """SIGKILL after the second batch (tests/loader_killed.py) of a loader taking half the
    samples: the last state it wrote resumes with the batches the whole run gave after it."""
    import subprocess
    import sys

    from test_loader_ops import batch_digest, killed_loader

    extra = {"subsample": 0.5}
    with killed_loader(op_shards, reader, backend, **extra) as whole:
        want = [batch_digest(b) for b in whole]
    out = tmp_path / "killed.jsonl"
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "loader_killed.py"),
                           str(op_shards), reader, backend, "2", str(out), json.dumps(extra)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["digest"] for line in lines] == want[:2]
    with killed_loader(op_shards, reader, backend, **extra) as resumed:
        resumed.load_state_dict(lines[-1]["state"])
        assert [batch_digest(b) for b in resumed] == want[2:]
    keys = [k for d in want for k in d[0].split(",") if k]
    assert len(keys) == len(set(keys)) and 10 <= len(keys) <= 30  # about half of 40


def test_epoch_samples_cuts_and_wraps_the_sources_epochs_and_resumes_exactly(data):
    every = _all_keys(data["image"])  # 60
    common = {**IMAGE, "reader": "stream"}
    with image_loader(data["image"], epoch_samples=24, **common) as cut:
        assert len(cut) == 4
        first, second = _keys(cut), _keys(cut)
        assert len(first) == len(second) == 24
        assert not set(first) & set(second)  # the next epoch goes on where the last stopped
    with image_loader(data["image"], epoch_samples=90, **common) as wrap:
        keys = _keys(wrap)
        assert len(keys) == 90 and set(keys) == every  # all, then 30 of the next pass
        assert len(set(keys[:60])) == 60

    def make():
        return image_loader(data["image"], epoch_samples=40, **common)

    head, rest, again = resumed_run(make, after=3)
    assert [b.keys for b in again] == [b.keys for b in rest] and len(head + rest) == 7
    with pytest.raises(ValueError, match="epoch_samples and epoch_batches both"):
        image_loader(data["image"], epoch_samples=10, epoch_batches=2, **common)
    with pytest.raises(ValueError, match="epoch_samples=0: a whole number"):
        image_loader(data["image"], epoch_samples=0, **common)


def _label_three(key, members):
    return members["cls"] == b"3"


def _label_seven(key, members):
    return members["cls"] == b"7"


def test_a_named_predicate_is_checked_on_resume_and_a_partial_has_no_address(data):
    import functools

    from shardflow.loading.subset import Subset

    with image_loader(data["image"], select=_label_three, **IMAGE) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with image_loader(data["image"], select=_label_three, **IMAGE) as same:
        same.load_state_dict(state)
    with image_loader(data["image"], select=_label_seven, **IMAGE) as other, \
            pytest.raises(ValueError, match="it differs in subset"):
        other.load_state_dict(state)
    named = Subset(0, select=functools.partial(_label_three, "k")).describe()["select"]
    assert named == "partial(test_subset._label_three)" and "0x" not in named
