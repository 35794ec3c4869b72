"""The fast paths of the loaders give what the straightforward code gives: the byte
tokenizer's whole-read encoding, masking that looks only at the drawn positions, DALI outputs
converted in one copy, reader states written out only when used, batches handed over in
bursts, and the tokenizer running ahead in helper threads."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from shardflow import text_loader
from shardflow.builtin import make_text_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.loading import consumed, reader_dali
from shardflow.loading.deferred import Deferred, resolved
from shardflow.loading.prefetch import Burst, Stage, ahead
from shardflow.loading.readplan import plan_epoch
from shardflow.loading.shardlist import ShardSpec, Source
from shardflow.text import masking, packing, tokenize
from shardflow.text.tokenizer import ByteTokenizer

OPTS = {"device": "cpu", "shuffle_buffer": 16, "prefetch": 2}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    docs = make_text_corpus(root / "docs", docs=90)
    convert(ConvertConfig(kind="text", src=str(docs), out=root / "shards", max_count=12,
                          workers=1))
    return root


# -- the byte tokenizer's whole-read encoding -----------------------------------------------------

@pytest.mark.parametrize("texts", [["ab", "é日本", "x"], ["one"], ["a\x00b", "c"],
                                   ["tail\x00", "\x00"], ["  ", "z" * 5000]])
def test_byte_tokenizer_packs_a_read_as_the_per_document_path(texts):
    tok = ByteTokenizer()
    tokens, starts = tok.encode_packed(texts, tok.sep_id)
    want_tokens, want_starts = packing.join(tok.encode_batch(texts), tok.sep_id)
    assert tokens.dtype == want_tokens.dtype == np.int32
    assert starts.dtype == want_starts.dtype == np.int64
    assert np.array_equal(tokens, want_tokens) and np.array_equal(starts, want_starts)
    docs = packing.documents(tokens, starts)
    assert [bytes(d.astype(np.uint8)).decode() for d in docs] == texts


def test_documents_of_an_empty_read_is_empty():
    assert packing.documents(np.zeros(0, np.int32), np.zeros(0, np.int64)) == []


# -- masking ------------------------------------------------------------------------------------

def _reference_mlm(ids, attention, rng, *, mask_id, normal_ids, special_ids, prob):
    """BERT's masking over the whole array, one step at a time: what masking.mlm must give,
    with its 16-bit uniform draws (u in [0, 1) in steps of 1/65536: the raw 64-bit words cut
    in four, lowest bits first)."""
    words = rng.bit_generator.random_raw(-(-ids.size // 4))
    u16 = [(int(w) >> (16 * i)) & 0xFFFF for w in words for i in range(4)][: ids.size]
    u = np.array(u16, np.float64).reshape(ids.shape) / 65536
    p = round(prob * 65536) / 65536  # prob as the 16-bit draws hold it
    chosen = (u < p) & attention.astype(bool) & ~np.isin(ids, special_ids)
    labels = np.where(chosen, ids, masking.IGNORE)
    inputs = ids.copy()
    mask_below, swap_below = (round(prob * 65536) * 8 // 10) / 65536, \
        (round(prob * 65536) * 9 // 10) / 65536
    inputs[chosen & (u < mask_below)] = mask_id
    swap = chosen & (u >= mask_below) & (u < swap_below)
    if swap.any():
        inputs[swap] = normal_ids[rng.integers(0, len(normal_ids), int(swap.sum()))]
    return inputs, labels


@pytest.mark.parametrize("specials", [(256, 257, 258), tuple(range(250, 262))])
@pytest.mark.parametrize("prob", [0.15, 0.6])
def test_masking_gives_the_whole_array_reference_draw_for_draw(specials, prob):
    data = np.random.default_rng(1)
    normal = np.arange(250, dtype=np.int32)
    for trial in range(40):
        ids = data.integers(0, 262, (int(data.integers(1, 9)), 32)).astype(np.int64)
        attention = np.ones_like(ids)
        attention[-1, int(data.integers(0, 32)):] = 0  # an epoch's last, padded row
        got = masking.mlm(ids, attention, masking.batch_rng(0, trial, 0, 1), mask_id=258,
                          normal_ids=normal, special_ids=specials, prob=prob)
        want = _reference_mlm(ids, attention, masking.batch_rng(0, trial, 0, 1), mask_id=258,
                              normal_ids=normal, special_ids=specials, prob=prob)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


# -- DALI's outputs in one copy ------------------------------------------------------------------

class _Scattered:
    """A TensorList whose samples are not one buffer: as_reshaped_tensor refuses, as DALI
    does for such a list."""

    def __init__(self, samples):
        self.samples = [np.frombuffer(s, np.uint8) for s in samples]

    def shape(self):
        return [list(s.shape) for s in self.samples]

    def as_reshaped_tensor(self, shape):
        raise RuntimeError("not contiguous")

    def __getitem__(self, i):
        return self.samples[i]


@pytest.mark.dali
def test_dali_outputs_are_split_from_one_copy_or_sample_by_sample():
    from nvidia.dali.backend import TensorListCPU

    samples = [b"abc", b"", b"de", b"f" * 1000]
    listed = TensorListCPU([np.frombuffer(s, np.uint8) if s else np.zeros(0, np.uint8)
                            for s in samples])  # one buffer, as the reader's outputs
    for tl, want in ((listed, samples), (_Scattered(samples), samples)):
        for take in (len(want), 2):
            got = reader_dali._arrays(tl, take)
            assert [a.tobytes() for a in got] == want[:take]
            assert all(a.dtype == np.uint8 and a.ndim == 1 for a in got)
    assert reader_dali._strings(_Scattered([b"s:1:k.txt", b""]), 2) == ["s:1:k.txt", ""]


@pytest.mark.dali
def test_sources_are_named_in_one_pass_as_sample_by_sample():
    from nvidia.dali.backend import TensorListCPU

    from shardflow.loading.batch import EncodedBatch

    def column(sources):
        return TensorListCPU([np.frombuffer(s.encode(), np.uint8) if s else np.zeros(0, np.uint8)
                              for s in sources])

    def each(sources, take):
        batch = EncodedBatch([], [], [], [])
        reader_dali._name_each(batch, [column(sources)], take)
        return batch.urls, batch.keys

    sources = ["/d/s-0.tar:512:doc_1.tokens.u16", "/d/s-1.tar:2048:a.b.seg.png",
               "http://host:8080/x.tar:1536:dir.v2/k7.jpg", "/d/s-0.tar:4096:plain",
               "s3://b/p q.tar:0:ü.txt", "/pad.tar:1:padding.txt"]
    for take in (5, 1):
        got = reader_dali._named(column(sources), take)
        assert got == each(sources, take)
    assert got is not None and reader_dali._named(column(sources), 5) == (
        ["/d/s-0.tar", "/d/s-1.tar", "http://host:8080/x.tar", "/d/s-0.tar", "s3://b/p q.tar"],
        ["doc_1", "a", "dir.v2/k7", "plain", "ü"])
    # An empty source (a sample without the member), or one that does not parse: per sample.
    for odd in (["/d/s-0.tar:512:a.txt", ""], ["/d/s-0.tar:512:a.txt", "no-colons"],
                ["/d/s-0.tar:512:a\nb.txt", "/d/s-0.tar:9:c.txt"]):
        assert reader_dali._named(column(odd), 2) is None


# -- reader states written out when used ----------------------------------------------------------

def test_a_deferred_part_is_computed_once_and_resolved_anywhere_in_a_state():
    calls = []
    part = Deferred(lambda: calls.append(1) or {"done": [1]})
    state = {"reader": {"consumed": part, "n": 3}, "list": [part, 2], "plain": "x"}
    want = {"reader": {"consumed": {"done": [1]}, "n": 3}, "list": [{"done": [1]}, 2],
            "plain": "x"}
    assert resolved(state) == want and resolved(state) == want
    assert calls == [1]
    assert json.loads(json.dumps(resolved(state))) == want
    assert resolved(None) is None


def test_a_snapshot_stays_what_was_read_when_it_was_taken(tmp_path):
    specs = tuple(ShardSpec(str(tmp_path / f"s{i}.tar"), 3) for i in range(3))
    plan = plan_epoch(Source(specs), epoch=0, seed=0, rank=0, world_size=1, batch_size=2,
                      shuffle=False, shuffle_buffer=0)
    tracker = consumed.Tracker(plan, None)
    enc = _encoded([(specs[0].url, "a"), (specs[1].url, "x")])
    tracker.add(enc)
    first = tracker.snapshot()
    tracker.add(_encoded([(specs[0].url, "b"), (specs[0].url, "c"), (specs[1].url, "y")]))
    second = tracker.snapshot()
    i0, i1 = (consumed.shard_index(plan)[s.url] for s in specs[:2])
    assert resolved(first) == {"done": [], "partial": sorted([[i0, ["a"]], [i1, ["x"]]])}
    assert resolved(second) == {"done": [i0], "partial": [[i1, ["x", "y"]]]}
    tracker.add(_encoded([(specs[1].url, "z")]))
    assert resolved(second)["partial"] == [[i1, ["x", "y"]]]  # unchanged by later reads


def test_interleaved_shards_are_tracked_as_sample_by_sample(tmp_path):
    # The shuffle buffer interleaves shards within a read; the tracker adds each shard's run
    # at once, keeping each shard's reading order and ending a shard at its count.
    specs = tuple(ShardSpec(str(tmp_path / f"s{i}.tar"), 4) for i in range(3))
    plan = plan_epoch(Source(specs), epoch=0, seed=0, rank=0, world_size=1, batch_size=2,
                      shuffle=False, shuffle_buffer=0)
    rng = np.random.default_rng(0)
    order = [(s.url, f"{n}-{k}") for n, s in enumerate(specs) for k in range(4)]
    order = [order[i] for i in rng.permutation(len(order))]
    order.insert(5, (str(tmp_path / "elsewhere.tar"), "zz"))  # a URL the plan does not have
    tracker = consumed.Tracker(plan, None)
    reads = [order[:7], order[7:8], order[8:]]
    ids = consumed.shard_index(plan)
    want: dict[int, list[str]] = {}
    for read in reads:
        tracker.add(_encoded(read))
        for url, key in read:
            if url in ids:
                want.setdefault(ids[url], []).append(key)
        done = sorted(i for i, keys in want.items() if len(keys) >= 4)
        partial = [[i, keys] for i, keys in sorted(want.items()) if len(keys) < 4]
        assert resolved(tracker.snapshot()) == {"done": done, "partial": partial}
    assert resolved(tracker.snapshot()) == {"done": [0, 1, 2], "partial": []}


def _encoded(samples):
    from shardflow.loading.batch import EncodedBatch

    return EncodedBatch([k for _, k in samples], [u for u, _ in samples],
                        [np.zeros(1, np.uint8) for _ in samples], [None for _ in samples])


# -- bursts and helper threads --------------------------------------------------------------------

def test_a_stage_hands_a_burst_over_item_by_item_in_order():
    def produce(stop):
        yield 0
        yield Burst([1, 2, 3])
        yield Burst()
        yield 4

    stage = Stage(produce, depth=1, name="test-burst")
    assert list(stage) == [0, 1, 2, 3, 4] and stage.completed
    stage.close()


def test_ahead_keeps_the_order_re_raises_and_leaves_no_thread():
    def slow_square(x):
        threading.Event().wait(0.001 * (x % 3))  # finish out of order in the pool
        if x == 13:
            raise ValueError("thirteen")
        return x * x

    got = list(ahead(slow_square, ((i, i) for i in range(12)), 4, name="test-ahead", workers=2))
    assert got == [(i, i * i) for i in range(12)]
    with pytest.raises(ValueError, match="thirteen"):
        list(ahead(slow_square, ((i, i) for i in range(20)), 4, name="test-ahead", workers=2))
    early = ahead(slow_square, ((i, i) for i in range(20)), 4, name="test-ahead", workers=2)
    assert next(early) == (0, 0)
    early.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-ahead")]


@pytest.mark.backend
def test_the_tokenizer_ahead_gives_the_batches_of_the_inline_path(shards, monkeypatch):
    pytest.importorskip("tokenizers")
    from shardflow.text.tokenizer import train_bpe

    texts = [p.read_text(encoding="utf-8") for p in sorted((shards / "docs").iterdir())]
    path = shards / "bpe.json"
    train_bpe(texts, path, 300)
    make = {"batch_size": 4, "seq_len": 24, "objective": "mlm", "tokenizer": path, **OPTS}

    def epochs():
        with text_loader(shards / "shards", **make) as loader:
            return [b for _ in range(2) for b in loader]

    threaded = epochs()
    monkeypatch.setattr(tokenize, "releases_gil", lambda tok: False)
    inline = epochs()
    assert len(threaded) == len(inline) > 8
    for a, b in zip(threaded, inline, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert a.keys == b.keys


def test_ahead_delivers_what_came_before_an_error_of_its_items():
    def items():
        yield from ((i, i) for i in range(5))
        raise OSError("the reader broke")

    got = []
    with pytest.raises(OSError, match="the reader broke"):
        for pair in ahead(lambda x: -x, items(), 3, name="test-ahead", workers=2):
            got.append(pair)
    assert got == [(i, -i) for i in range(5)]  # as without the helpers: all, then the error
    assert not [t for t in threading.enumerate() if t.name.startswith("test-ahead")]


def test_ahead_raises_fns_error_in_order_before_any_later_result():
    """fn failing on item k: the results before k, then its error; nothing after k is
    handed over first (a batch past the failed one would carry a reader state beyond it)."""
    def fails_at_3(x):
        if x == 3:
            raise ValueError("three")
        threading.Event().wait(0.01 if x < 3 else 0.0)  # the later ones finish first
        return x

    got = []
    with pytest.raises(ValueError, match="three"):
        for pair in ahead(fails_at_3, ((i, i) for i in range(10)), 4, name="test-ahead",
                          workers=3):
            got.append(pair)
    assert got == [(0, 0), (1, 1), (2, 2)]
    assert not [t for t in threading.enumerate() if t.name.startswith("test-ahead")]


def test_a_packed_position_keeps_the_reads_layout_not_its_tokens():
    from shardflow.text import elastic

    packer = packing.Packer(8)
    tokens, starts = ByteTokenizer().encode_packed(["abcdef", "ghij", "kl"], 257)
    piece = packing.Piece(None, tokens, starts, ["a", "b", "c"], urls=["u"] * 3,
                          read=[("u", "a"), ("u", "b"), ("u", "c"), ("u", "held-out")])
    packer.add(piece, {})
    packer.take()  # 8 tokens: "abcdef" and its separator, then "g" of the second
    part = elastic.in_progress(packer, {"u": 0})
    args = part._make.args
    assert not any(isinstance(a, packing.Piece) for a in args)
    assert all(a.size == 3 for a in args if isinstance(a, np.ndarray))  # starts, no tokens
    packer.take()
    assert resolved(part) == {"also": [[0, "a"], [0, "held-out"]], "cut": [0, "b", 1]}
