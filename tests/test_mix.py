"""Mixing datasets by weight (pipeline/loading/mix.py): draws by weight from the seed alone,
per-source counts, an epoch of a given number of batches, exact resume, bad mixtures refused."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from conftest import make_image_folder

from pipeline import image_loader, text_loader
from pipeline.builtin import make_text_corpus
from pipeline.convert import ConvertConfig, convert

OPTS = {"batch_size": 4, "size": 16, "device": "cpu", "threads": 1, "use_tuning": False}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two image datasets: a (24 images, 3 shards) and b (16 images, 2 shards)."""
    root = tmp_path_factory.mktemp("mix")
    out = []
    for name, per_class in (("a", 12), ("b", 8)):
        src = make_image_folder(root / f"src-{name}", classes=2, per_class=per_class)
        for folder in sorted(src.iterdir()):  # keys that tell the sources apart: a0_img003
            folder.rename(src / folder.name.replace("class", name))
        convert(ConvertConfig(kind="imagefolder", src=str(src), out=root / name, max_count=8,
                              workers=1))
        out.append(root / name)
    return out[0], out[1]


def _source_of(batch_keys: list[str], a_keys: set[str]) -> str:
    return "a" if batch_keys[0] in a_keys else "b"


def _keys(folder: Path) -> set[str]:
    with image_loader(folder, **OPTS) as loader:
        return {k for batch in loader for k in batch.keys}


def test_batches_follow_the_weights_from_the_seed_alone(sources):
    a, b = sources
    a_keys = _keys(a)
    make = functools.partial(image_loader, [(a, 3.0), (b, 1.0)], seed=5, epoch_batches=40,
                             **OPTS)
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
    with image_loader([(a, 3.0), (b, 1.0)], seed=6, epoch_batches=40, **OPTS) as other:
        assert [_source_of(batch.keys, a_keys) for batch in other] != order


def test_a_default_epoch_is_the_sources_epochs_together_and_resume_is_exact(sources):
    a, b = sources
    make = functools.partial(image_loader, [(a, 0.5), (b, 0.5)], seed=1, **OPTS)
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


@pytest.mark.parametrize("mixture, match", [
    (lambda a, b: [(a, 0.0), (b, 1.0)], "above 0"),
    (lambda a, b: [(a, float("nan")), (b, 1.0)], "above 0"),
    (lambda a, b: [(a, 1.0), (a, 1.0)], "twice"),
])
def test_bad_mixtures_are_refused(sources, mixture, match):
    with pytest.raises(ValueError, match=match):
        image_loader(mixture(*sources), **OPTS)


def test_a_state_of_another_mixture_is_refused(sources):
    a, b = sources
    with image_loader([(a, 1.0), (b, 1.0)], seed=1, **OPTS) as mixed:
        state = mixed.state_dict()
    with image_loader([(a, 1.0), (b, 3.0)], seed=1, **OPTS) as other, \
            pytest.raises(ValueError, match="weights"):
        other.load_state_dict(state)
