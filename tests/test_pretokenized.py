"""Text stored as token ids (make_shards text --tokenizer): the loader's batches are the ones
tokenizing at load time gives, on all three readers, through exact and elastic resume; another
tokenizer is refused; verify_shards checks the ids; a tokenizer.json that truncates or pads
cuts nothing."""

from __future__ import annotations

import io
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_tool

from shardflow import merge_states, text_loader
from shardflow.builtin import make_text_corpus
from shardflow.convert import ConvertConfig, convert
from shardflow.convert.sources import TextOptions
from shardflow.errors import DataError
from shardflow.shards.manifest import TokenForm, load_manifest
from shardflow.shards.verify import verify
from shardflow.text import pretokenized
from shardflow.text.tokenizer import load_tokenizer, train_bpe

OPTS = {"device": "cpu", "shuffle_buffer": 8, "prefetch": 2, "seq_len": 48}


def _convert(docs: Path, out: Path, tokenizer: str | None, **kw) -> None:
    convert(ConvertConfig(kind="text", src=str(docs), out=out, max_count=20, workers=1,
                          text=TextOptions(tokenizer=tokenizer), **kw))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """120 documents as text shards and as ids of the byte tokenizer (and of a BPE when HF
    tokenizers is installed), converted alike."""
    root = tmp_path_factory.mktemp("pretok")
    docs = make_text_corpus(root / "docs", docs=120)
    _convert(docs, root / "text", None)
    _convert(docs, root / "bytes", "bytes")
    found = {"bytes": ("bytes", root / "bytes")}
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return root, docs, found
    bpe = root / "bpe.json"
    train_bpe((p.read_text(encoding="utf-8") for p in sorted(docs.iterdir())), bpe, 400)
    _convert(docs, root / "bpe", str(bpe))
    found["bpe"] = (str(bpe), root / "bpe")
    return root, docs, found


def _all(source, tokenizer, **kw) -> list:
    with text_loader(source, batch_size=4, tokenizer=tokenizer, **{**OPTS, **kw}) as loader:
        return list(loader)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
        and torch.equal(x.attention_mask, y.attention_mask) and x.keys == y.keys
        for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["bytes", "bpe"])
@pytest.mark.parametrize("reader,objective,packing", [
    ("dali", "mlm", True), ("stream", "clm", True), ("dali", "clm", False),
    ("index", "mlm", True), ("index", "clm", False)])
def test_stored_ids_give_the_batches_of_tokenizing_at_load_time(corpus, name, reader,
                                                                objective, packing):
    root, _, found = corpus
    if name not in found:
        pytest.skip("HF tokenizers is not installed (pip install 'shardflow[text]')")
    tokenizer, ids = found[name]
    kw = {"reader": reader, "objective": objective, "packing": packing, "seed": 5}
    want = _all(root / "text", tokenizer, **kw)
    got = _all(ids, tokenizer, **kw)
    assert len(want) > 10
    assert _same(got, want)


def test_the_manifest_names_the_tokenizer_and_the_member(corpus):
    root, docs, found = corpus
    m = load_manifest(str(found["bytes"][1] / "manifest.json"))
    assert m.tokens == TokenForm("bytes", 259, None, "tokens.u16", "uint16")
    assert m.modality == "text" and m.total_samples == len(list(docs.iterdir()))
    with tarfile.open(next(found["bytes"][1].glob("*.tar"))) as tar:
        member = next(m for m in tar if m.name.endswith(".tokens.u16"))
        key = member.name.split(".", 1)[0]
        ids = np.frombuffer(tar.extractfile(member).read(), "<u2")  # type: ignore[union-attr]
    assert bytes(ids.astype(np.uint8)) == (docs / f"{key}.txt").read_bytes()
    if "bpe" in found:
        bpe = load_manifest(str(found["bpe"][1] / "manifest.json")).tokens
        assert bpe is not None and bpe.tokenizer == "hf" and bpe.vocab_size == 400
        assert bpe.sha256 == load_tokenizer(found["bpe"][0]).describe()["sha256"]


@pytest.mark.parametrize("reader", ["dali", "stream", "index"])
def test_exact_resume_on_stored_ids(corpus, reader):
    _, _, found = corpus
    tokenizer, ids = found.get("bpe", found["bytes"])
    kw = {"reader": reader, "objective": "mlm"}
    whole = _all(ids, tokenizer, **kw)
    for stop in (1, 5, len(whole) - 1):
        with text_loader(ids, batch_size=4, tokenizer=tokenizer, **OPTS, **kw) as first:
            for n, _ in enumerate(first, 1):
                if n == stop:
                    break
            state = json.loads(json.dumps(first.state_dict()))
        with text_loader(ids, batch_size=4, tokenizer=tokenizer, **OPTS, **kw) as second:
            second.load_state_dict(state)
            assert _same(list(second), whole[stop:]), f"after {stop}"


@pytest.mark.parametrize("reader", ["dali", "index"])
def test_elastic_resume_two_ranks_to_one_as_with_text(corpus, reader):
    """Documents cut between batches are started at their next token on the new rank count;
    stored ids do it as the tokenizing loader does, token for token."""
    root, _, found = corpus
    tokenizer, ids = found.get("bpe", found["bytes"])
    kw = {**OPTS, "tokenizer": tokenizer, "reader": reader}

    def run(source: Path) -> list:
        first, states = [], []
        for rank in range(2):
            with text_loader(source, batch_size=3, rank=rank, world_size=2, **kw) as loader:
                for n, batch in enumerate(loader, 1):
                    first.append(batch)
                    if n == 5:
                        break
                states.append(loader.state_dict(gather=False))
        with text_loader(source, batch_size=3, **kw) as one:
            one.load_state_dict(merge_states(states))
            return first + list(one)

    want, got = run(root / "text"), run(ids)
    assert len(want) > 12
    assert _same(got, want)


def test_another_tokenizer_is_refused_naming_both(corpus, tmp_path):
    _, docs, found = corpus
    other = tmp_path / "other.json"
    pytest.importorskip("tokenizers")
    train_bpe((p.read_text(encoding="utf-8") for p in sorted(docs.iterdir())), other, 300)
    with pytest.raises(ValueError, match=r"tokenized with 'bytes' \(vocab_size 259\), this "
                       r"loader has 'hf' \(vocab_size 300, sha256"):
        text_loader(found["bytes"][1], batch_size=4, tokenizer=other, **OPTS)
    if "bpe" in found:
        with pytest.raises(ValueError, match=r"tokenized with 'hf' \(vocab_size 400.*this "
                           r"loader has 'bytes'"):
            text_loader(found["bpe"][1], batch_size=4, **OPTS)  # the default: bytes


def _stored_ids(out: Path) -> dict[str, np.ndarray]:
    """The uint16 ids of every document in the shards of `out`, by key, read with tarfile."""
    stored = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            stored.update({m.name.split(".", 1)[0]: np.frombuffer(
                tar.extractfile(m).read(), "<u2")  # type: ignore[union-attr]
                for m in tar if m.name.endswith(".tokens.u16")})
    return stored


def _rewrite(shard: Path, member_bytes: dict[str, bytes]) -> None:
    """The shard with some members' bytes replaced (the .idx beside it goes stale)."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]  # type: ignore[union-attr]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for m, data in members:
            data = member_bytes.get(m.name, data)
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))
    shard.with_suffix(".idx").unlink()


def test_ids_out_of_the_vocabulary_are_found_by_verify_and_skipped_by_the_loader(corpus,
                                                                                   tmp_path):
    root, docs, _ = corpus
    out = tmp_path / "ids"
    _convert(docs, out, "bytes")
    shard = sorted(out.glob("*.tar"))[1]
    with tarfile.open(shard) as tar:
        names = [m.name for m in tar][:2]
    bad = {names[0]: np.array([65, 300, 66], "<u2").tobytes(), names[1]: b"\x41"}
    _rewrite(shard, bad)
    reports, _ = verify(str(out))
    problems = [p for r in reports for p in r.problems if p["reason"] == "bad-tokens"]
    assert {p["key"] for p in problems} == {n.split(".", 1)[0] for n in names}
    assert all(p["source"].endswith(shard.name) for p in problems)
    assert any("token id 300 is not below the tokenizer's vocab_size 259" in p["detail"]
               for p in problems)
    with text_loader(out, batch_size=4, on_error="skip", **OPTS) as loader:
        keys = {k for b in loader for k in b.keys}
        skipped = loader.skipped
    assert keys == {p.stem for p in docs.iterdir()} - {n.split(".", 1)[0] for n in names}
    assert sorted(s["reason"] for s in skipped) == ["bad-tokens", "bad-tokens"]
    with text_loader(out, batch_size=4, **OPTS) as loader, \
            pytest.raises(DataError, match="bad-tokens"):
        list(loader)


def test_a_tokenizer_file_that_truncates_and_pads_cuts_nothing(tmp_path, caplog):
    tokenizers = pytest.importorskip("tokenizers")
    docs = make_text_corpus(tmp_path / "docs", docs=30)
    texts = [p.read_text(encoding="utf-8") for p in sorted(docs.iterdir())]
    plain = tmp_path / "plain.json"
    train_bpe(texts, plain, 300)
    tok = tokenizers.Tokenizer.from_file(str(plain))
    tok.enable_truncation(max_length=12)
    tok.enable_padding(length=12, pad_id=0, pad_token="[PAD]")
    cutting = tmp_path / "cutting.json"
    cutting.write_text(tok.to_str(), encoding="utf-8")
    assert len(tok.encode(texts[0]).ids) == 12  # the file as saved cuts every document
    with caplog.at_level(logging.WARNING):
        loaded = load_tokenizer(cutting)
    assert "truncation (max_length=12) and padding (length=12)" in caplog.text
    whole = load_tokenizer(plain).encode_batch(texts)
    assert all(np.array_equal(a, b) for a, b in zip(loaded.encode_batch(texts), whole,
                                                    strict=True))
    assert max(map(len, whole)) > 100
    # at conversion too: the stored ids are the whole documents'
    _convert(docs, tmp_path / "ids", str(cutting))
    stored = _stored_ids(tmp_path / "ids")
    for path, ids in zip(sorted(docs.iterdir()), whole, strict=True):
        assert np.array_equal(stored[path.stem], ids)


class _BigVocabulary:
    """A tokenizer object whose vocabulary needs uint32 ids."""

    def describe(self) -> dict:
        return {"tokenizer": "custom", "vocab_size": 70_000}


def test_uint32_ids_for_vocabularies_over_65536():
    form = pretokenized.form_of(_BigVocabulary())
    assert (form.member, form.dtype) == ("tokens.u32", "uint32")
    docs = [np.array([1, 69_999, 65_536], "<u4"), np.array([7], "<u4")]
    data = [np.frombuffer(d.tobytes(), np.uint8) for d in docs]
    tokens, starts = pretokenized.packed(data, form, sep_id=3)
    assert tokens.tolist() == [1, 69_999, 65_536, 3, 7, 3] and starts.tolist() == [0, 4]
    assert pretokenized.ids_of(data[0], form).tolist() == [1, 69_999, 65_536]
    over = np.frombuffer(np.array([70_000], "<u4").tobytes(), np.uint8)
    assert pretokenized.packed([data[0], over], form, sep_id=3) is None
    with pytest.raises(DataError, match="token id 70000 is not below"):
        pretokenized.ids_of(over, form)
    with pytest.raises(DataError, match="not a whole number of uint32 ids"):
        pretokenized.ids_of(data[0][:5], form)


def test_make_shards_tokenizes_and_reshards_keep_the_ids(corpus, tmp_path):
    root, docs, _ = corpus
    run_tool("make_shards", "text", docs, tmp_path / "a", "--tokenizer", "bytes",
             "--max-count", 30, check=True)
    run_tool("verify_shards", tmp_path / "a", check=True)
    # existing text shards tokenized on the way; and shards of ids re-sharded without one
    run_tool("make_shards", "shards", root / "text", tmp_path / "b", "--tokenizer", "bytes",
             check=True)
    run_tool("make_shards", "shards", tmp_path / "b", tmp_path / "c", "--max-count", 50,
             check=True)
    # ids tokenized again would keep the old ids under the new name: refused, nothing written
    proc = run_tool("make_shards", "shards", tmp_path / "b", tmp_path / "d", "--tokenizer",
                    "bytes")
    assert proc.returncode != 0 and "holds token ids already" in proc.stderr
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
    # the byte tokenizer by its definition (an id a UTF-8 byte), on each source document
    want_ids = {p.stem: np.frombuffer(p.read_bytes(), np.uint8) for p in docs.iterdir()}
    for out in ("a", "b", "c"):
        m = load_manifest(str(tmp_path / out / "manifest.json"))
        assert m.tokens is not None and m.tokens.member == "tokens.u16", out
        stored = _stored_ids(tmp_path / out)
        assert sorted(stored) == sorted(want_ids), out
        for key, ids in stored.items():
            assert np.array_equal(ids, want_ids[key]), (out, key)
    want = _all(root / "text", "bytes", train=False)
    for out in ("b", "c"):
        got = _all(tmp_path / out, "bytes", train=False)
        assert sorted(k for b in got for k in b.keys) == sorted(k for b in want for k in b.keys)
        assert sum(int(b.attention_mask.sum()) for b in got) == \
            sum(int(b.attention_mask.sum()) for b in want)
