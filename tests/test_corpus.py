"""The bad-input corpus, end to end through the loaders of every modality.

Every case of shared/BAD_INPUTS.md that can reach a loader, and cases a careful attacker or an
unlucky user would add, built as real shards in two folders:

- "made": shards written by shardflow (with .idx, so both readers read them), some damaged
  afterwards: cut inside a member, emptied, replaced by an HTML error page, one holding every
  bad sample of the modality;
- "foreign": hand-built tars without .idx (the streaming reader): a key twice, a key's members
  apart, names with `../`, absolute paths, links and devices, pickles, a member declaring a
  petabyte, a name that is not UTF-8.

For each modality and reader, under `skip` one pass over a whole folder names every bad sample
or shard with its reason, lets no bad sample into a batch and no key in twice, and
read + skipped == total in samples (manifest.json's counts); under `raise` each case alone next
to a good shard stops with a DataError naming the shard, the key (for a sample) and the reason.
Nothing is unpickled (a marker file would appear) and nothing lands outside the shards' folder.

The tools, configuration, URLs, checkpoints and faults are covered by the tests CATEGORIES
lists; `test_every_category_names_tests_that_exist` keeps that list honest.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import os
import pickle
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from badfiles import (
    ABSURD,
    HTML_PAGE,
    Payload,
    bad_samples,
    declare_size,
    good,
    member_info,
    npy,
    png16,
    png_declaring,
    special,
    tar_bytes,
)
from conftest import deadline, jpeg_bytes

from shardflow.errors import DataError
from shardflow.image.loader import image_loader
from shardflow.loading.reader_dali import check_local_shard
from shardflow.pointcloud.loader import pointcloud_loader
from shardflow.samples.checks import check_label
from shardflow.shards.daliindex import format_index
from shardflow.shards.manifest import Manifest, ShardInfo
from shardflow.shards.writer import ShardWriter
from shardflow.text.loader import text_loader

Members = dict[str, bytes]


# -- the good samples of each modality, and its loader ---------------------------------------

def good_members(modality: str, i: int) -> Members:
    if modality == "image":
        return {"jpg": jpeg_bytes(i, (20, 16)), "cls": b"%d" % (i % 2)}
    if modality == "text":
        return {"txt": f"good document number {i}, plain and short.".encode()}
    return {"npy": npy(good(1000 + i)), "cls": b"%d" % (i % 2)}


LOADERS: dict[str, Callable[..., Any]] = {
    "image": functools.partial(image_loader, batch_size=4, train=False, device="cpu", size=16,
                               threads=1, num_classes=2, max_pixels=1_000_000),
    "text": functools.partial(text_loader, batch_size=4, seq_len=32, device="cpu",
                              shuffle_buffer=0),
    "pointcloud": functools.partial(pointcloud_loader, batch_size=4, train=False, device="cpu",
                                    num_points=16, threads=1, num_classes=2),
}


# -- bad samples: key -> (members, reason, or None for odd but valid) -------------------------

def image_samples(marker: Path) -> dict[str, tuple[Members, str | None]]:
    ok = jpeg_bytes(50, (20, 16))
    scan = ok[:300] + np.random.default_rng(1).bytes(len(ok) - 300)
    return {
        "nolabel": ({"jpg": ok}, "missing-field"),
        "noimage": ({"cls": b"0"}, "missing-field"),
        "label-word": ({"jpg": ok, "cls": b"cat"}, "bad-label"),
        "label-range": ({"jpg": ok, "cls": b"7"}, "label-out-of-range"),
        "label-negative": ({"jpg": ok, "cls": b"-1"}, "label-out-of-range"),
        # int() would take these three: "1_0" is 10, Arabic-Indic digits are digits, and a
        # label past int64 overflows the label tensor.
        "label-underscore": ({"jpg": ok, "cls": b"1_0"}, "bad-label"),
        "label-arabic": ({"jpg": ok, "cls": "\u0661".encode()}, "bad-label"),
        "label-huge": ({"jpg": ok, "cls": b"9" * 30}, "label-out-of-range"),
        "truncated": ({"jpg": ok[:200], "cls": b"0"}, "bad-image"),
        "noise": ({"jpg": np.random.default_rng(2).bytes(2000), "cls": b"0"}, "bad-image"),
        "corrupt-scan": ({"jpg": scan, "cls": b"0"}, "bad-image"),
        "svg": ({"jpg": b'<svg xmlns="http://www.w3.org/2000/svg"/>', "cls": b"0"},
                "bad-image"),
        "bomb": ({"png": png_declaring(20_000, 20_000), "cls": b"0"}, "too-many-pixels"),
        "zero-size": ({"png": png_declaring(0, 0), "cls": b"0"}, "bad-image"),
        # odd but valid: RGB uint8 out; a pickle beside the image is never opened (loaders
        # read only the members they decode; make_shards and verify_shards refuse it)
        "pickled": ({"jpg": ok, "cls": b"0", "pkl": pickle.dumps(Payload(marker))}, None),
        "one-pixel": ({"png": jpeg_bytes(3, (1, 1), "RGB", "PNG"), "cls": b"1"}, None),
        "thin": ({"jpg": jpeg_bytes(4, (1, 300)), "cls": b"1"}, None),
        "gray": ({"jpg": jpeg_bytes(5, (20, 16), "L"), "cls": b"1"}, None),
        "alpha": ({"png": jpeg_bytes(6, (20, 16), "RGBA", "PNG"), "cls": b"1"}, None),
        "cmyk": ({"jpg": jpeg_bytes(7, (20, 16), "CMYK"), "cls": b"1"}, None),
        "sixteen-bit": ({"png": png16(), "cls": b"1"}, None),
        "png-named-jpg": ({"jpg": jpeg_bytes(8, (20, 16), "RGB", "PNG"), "cls": b"1"}, None),
        "label-newline": ({"jpg": ok, "cls": b" 1\n"}, None),
    }


def text_samples(marker: Path) -> dict[str, tuple[Members, str | None]]:
    return {
        "latin1": ({"txt": b"caf\xe9 au lait"}, "bad-utf8"),
        "overlong": ({"txt": b"slash \xc0\xaf overlong"}, "bad-utf8"),
        "surrogate": ({"txt": b"lone \xed\xa0\x80 surrogate"}, "bad-utf8"),
        "utf16": ({"txt": "sixteen bits".encode("utf-16")}, "bad-utf8"),
        "nul": ({"txt": b"one\x00two"}, "nul-byte"),
        "empty": ({"txt": b""}, "empty-text"),
        "blank": ({"txt": b" \n\t \n"}, "empty-text"),
        "notext": ({"cls": b"1"}, "empty-text"),
        # odd but valid
        "pickled": ({"txt": b"a caption", "pickle": pickle.dumps(Payload(marker))}, None),
        "bom": ({"txt": b"\xef\xbb\xbfstarts with a byte order mark"}, None),
        "enormous": ({"txt": ("\u00e9" * 600_000).encode()}, None),  # 1.2 MB: cut, not skipped
    }


def pointcloud_samples(marker: Path) -> dict[str, tuple[Members, str | None]]:
    cases: dict[str, tuple[Members, str | None]] = dict(bad_samples(marker).items())
    cases["label-underscore"] = ({"npy": npy(good(12)), "cls": b"0_1"}, "bad-label")
    # odd but valid: other dtypes, byte order and layout; a pickle beside the cloud (unread)
    cases["pickle-member"] = ({"npy": npy(good(11)), "cls": b"0",
                               "pth": pickle.dumps(Payload(marker))}, None)
    cases["float64"] = ({"npy": npy(good(13).astype(np.float64)), "cls": b"1"}, None)
    cases["big-endian"] = ({"npy": npy(good(14).astype(">f4")), "cls": b"1"}, None)
    cases["fortran"] = ({"npy": npy(np.asfortranarray(good(15))), "cls": b"1"}, None)
    cases["normals"] = ({"npy": npy(np.random.default_rng(16).normal(size=(40, 6))
                                    .astype(np.float32)), "cls": b"1"}, None)
    return cases


SAMPLES = {"image": image_samples, "text": text_samples, "pointcloud": pointcloud_samples}


# -- bad shards --------------------------------------------------------------------------------

@dataclass
class ShardCase:
    """A shard, the samples it was meant to hold, and the reasons each reader's skip entries
    for it give ({reader: reasons}; no reasons: the shard is read whole)."""

    name: str
    samples: int
    expect: dict[str, set[str]]


def _partial(modality: str) -> set[str]:
    """A cut that leaves a sample with its first members only: an image or cloud then lacks a
    member (text has one member: its cut document is simply lost with the rest)."""
    return set() if modality == "text" else {"missing-field"}


def _written(folder: Path, prefix: str, samples: dict[str, Members]) -> ShardInfo:
    writer = ShardWriter(folder, prefix, max_count=1000, max_size=1 << 30)
    for key, members in samples.items():
        writer.write({"__key__": key, **members})
    info = writer.finish()
    assert info is not None
    return info


def _goods(modality: str, prefix: str, n: int) -> dict[str, Members]:
    return {f"{prefix}{i}": good_members(modality, i) for i in range(n)}


def made_shards(folder: Path, modality: str) -> list[ShardCase]:
    """Shards written by shardflow, then damaged the ways a disk or a user damages them."""
    cases = []
    info = _written(folder, "cut", _goods(modality, "cut", 4))
    shard = folder / info.name
    third = member_info(shard.read_bytes(), "cut2." + next(iter(good_members(modality, 0))))
    shard.write_bytes(shard.read_bytes()[:third.offset_data + 5])  # inside the third sample
    cases.append(ShardCase(info.name, 4, {"dali": {"truncated"},
                                          "stream": {"truncated"} | _partial(modality)}))
    info = _written(folder, "zero", _goods(modality, "zero", 3))
    (folder / info.name).write_bytes(b"")
    cases.append(ShardCase(info.name, 3, {"dali": {"truncated"}, "stream": {"empty-shard"}}))
    info = _written(folder, "html", _goods(modality, "html", 3))
    size = (folder / info.name).stat().st_size  # an error page longer than the shard it replaced
    (folder / info.name).write_bytes((HTML_PAGE * (size // len(HTML_PAGE) + 1))[:size + 700])
    cases.append(ShardCase(info.name, 3, {"dali": {"index-mismatch"},
                                          "stream": {"not-a-tar"}}))
    return cases


def _groups(data: bytes) -> int:
    """Samples as a reader sees them: runs of members with one key."""
    keys = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            key = m.name.split("/")[-1].split(".")[0] if m.isfile() else m.name
            if not keys or keys[-1] != key:
                keys.append(key)
    return len(keys)


def foreign_shards(folder: Path, modality: str, marker: Path) -> list[ShardCase]:
    """Hand-built tars without .idx: read by the streaming reader only."""
    g = [list(good_members(modality, 20 + i).items()) for i in range(3)]
    first_ext = g[0][0][0]
    escape_abs = str(folder.parent / "shardflow-evil-abs")

    def named(key: str, members: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        return [(f"{key}.{ext}", data) for ext, data in members]

    tars: dict[str, tuple[bytes, int | None, set[str]]] = {
        "dupkey": (tar_bytes(named("d-a", g[0]) + named("d-b", g[1]) + named("d-a", g[2])),
                   None, {"split-key"}),
        "unsafe": (tar_bytes(named("u-ok", g[0]) + [
            (f"../shardflow-evil-dotdot.{first_ext}", b"evil"),
            (f"{escape_abs}.{first_ext}", b"evil"),
            special(f"u-sym.{first_ext}", tarfile.SYMTYPE, "/etc/passwd"),
            special(f"u-hard.{first_ext}", tarfile.LNKTYPE, f"u-ok.{first_ext}"),
            special(f"u-fifo.{first_ext}", tarfile.FIFOTYPE),
            special(f"u-dev.{first_ext}", tarfile.CHRTYPE)]), None,
            {"unsafe-member-name", "not-a-regular-file"}),
        # Loaders open only the members they decode: a pickle beside them is never touched
        # (make_shards and verify_shards refuse it, since they would copy it on).
        "pickles": (tar_bytes(named("p-a", g[0]) + [("p-a.pyd", pickle.dumps(Payload(marker)))]
                              + named("p-b", g[1])), None, set()),
        "absurd": (declare_size(tar_bytes(named("z-a", g[0]) + named("z-b", g[1])),
                                f"z-b.{first_ext}", ABSURD), 2, {"member-too-large"}),
        "cut": (tar_bytes(named("c-a", g[0]) + named("c-b", g[1]))[:1536 + 100], 2,
                {"truncated"} | _partial(modality)),
        "html": (HTML_PAGE, 2, {"not-a-tar"}),
        "empty": (b"", 2, {"empty-shard"}),
    }
    cases = []
    for name, (data, samples, reasons) in tars.items():
        (folder / f"{name}-000000.tar").write_bytes(data)
        count = samples if samples is not None else _groups(data)
        cases.append(ShardCase(f"{name}-000000.tar", count, {"stream": reasons}))
    return cases


# -- the corpus on disk ------------------------------------------------------------------------

@dataclass
class Corpus:
    folder: Path
    total: int  # samples the shards were meant to hold (manifest.json's counts)
    shard_cases: list[ShardCase]
    sample_cases: dict[str, str | None]  # key -> reason, in samples-000000.tar
    good_keys: set[str]


def _save_manifest(folder: Path, modality: str, shards: list[ShardInfo]) -> None:
    classes = None if modality == "text" else {"a": 0, "b": 1}
    Manifest(shards, modality, classes).save(folder / "manifest.json")


def build_made(root: Path, modality: str, marker: Path) -> Corpus:
    folder = root / "made"
    folder.mkdir(parents=True)
    samples = SAMPLES[modality](marker)
    goods = _goods(modality, "good", 6)
    infos = [_written(folder, "good", goods),
             _written(folder, "samples", {k: m for k, (m, _) in samples.items()})]
    cases = made_shards(folder, modality)
    infos += [ShardInfo(c.name, c.samples, 0, "") for c in cases]
    _save_manifest(folder, modality, infos)
    return Corpus(folder, sum(i.samples for i in infos), cases,
                  {k: r for k, (_, r) in samples.items()}, set(goods))


def build_foreign(root: Path, modality: str, marker: Path) -> Corpus:
    folder = root / "foreign"
    folder.mkdir(parents=True)
    goods = _goods(modality, "fgood", 3)
    data = tar_bytes([(f"{k}.{ext}", b) for k, m in goods.items() for ext, b in m.items()])
    (folder / "fgood-000000.tar").write_bytes(data)
    cases = foreign_shards(folder, modality, marker)
    infos = [ShardInfo("fgood-000000.tar", 3, len(data), hashlib.sha256(data).hexdigest())]
    _save_manifest(folder, modality, infos + [ShardInfo(c.name, c.samples, 0, "")
                                              for c in cases])
    return Corpus(folder, 3 + sum(c.samples for c in cases), cases, {}, set(goods))


def one_pass(loader: Any) -> list[str]:
    """Every key of one pass, batch by batch; checks what reaches a batch on the way."""
    keys: list[str] = []
    with loader:
        for batch in loader:
            keys += batch.keys
            if hasattr(batch, "image"):  # any odd image comes out RGB uint8
                assert batch.image.dtype.is_floating_point is False
                assert batch.image.shape[:2] == (len(batch.keys), 3)
            if hasattr(batch, "points"):
                assert bool(batch.points.isfinite().all())
    return keys


def by_shard(entries: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        found.setdefault(Path(e["source"]).name, []).append(e)
    return found


READERS = [("made", "dali"), ("made", "stream"), ("foreign", "stream")]


@pytest.mark.parametrize("modality", list(LOADERS))
@pytest.mark.parametrize("kind, reader", READERS)
@pytest.mark.backend
def test_skip_names_every_bad_input_and_read_plus_skipped_is_total(tmp_path, modality, kind,
                                                                   reader):
    marker = tmp_path / "unpickled"
    corpus = (build_made if kind == "made" else build_foreign)(tmp_path, modality, marker)
    loader = LOADERS[modality](str(corpus.folder), on_error="skip", reader=reader)
    keys = one_pass(loader)
    read = set(keys)
    if modality != "text":  # a document's tokens may span batches; a sample never does
        assert len(keys) == len(read), "a sample came out twice"
    assert len(read) + loader.skipped_samples() == corpus.total
    assert loader.skipped_of_unknown_size() == 0
    entries = by_shard(loader.skipped)
    bad = {k: r for k, r in corpus.sample_cases.items() if r is not None}
    assert {e["key"]: e["reason"] for e in entries.pop("samples-000000.tar", [])} == bad
    for case in corpus.shard_cases:
        got = entries.pop(case.name, [])
        assert {e["reason"] for e in got} == case.expect[reader], case.name
        assert all(e["samples"] is not None for e in got)
    assert not entries, f"skips in shards that hold no bad input: {entries}"
    assert corpus.good_keys <= read and not read & set(bad)
    assert read >= {k for k, r in corpus.sample_cases.items() if r is None}
    assert not marker.exists(), "something from the data was unpickled"
    assert not list(tmp_path.rglob("shardflow-evil*")), "a member name was used as a path"
    if modality == "text" and kind == "made":
        assert loader.truncated_docs >= 1  # the enormous document, cut to max_doc_bytes


def sample_cases(modality: str) -> list[tuple[str, str, str]]:
    marker = Path("never-written")  # only the reasons are used here
    return [(modality, key, reason) for key, (_, reason) in SAMPLES[modality](marker).items()
            if reason is not None]


@pytest.mark.parametrize("reader", ["dali", "stream"])
@pytest.mark.parametrize("modality, key, reason",
                         [c for m in LOADERS for c in sample_cases(m)])
@pytest.mark.backend
def test_raise_on_a_bad_sample_names_shard_key_and_reason(tmp_path, modality, key, reason,
                                                          reader):
    marker = tmp_path / "unpickled"
    members, _ = SAMPLES[modality](marker)[key]
    shards = [_written(tmp_path, "good", _goods(modality, "good", 3)),
              _written(tmp_path, "bad", {**_goods(modality, "also", 2), key: members})]
    with pytest.raises(DataError) as info:
        one_pass(LOADERS[modality]([str(tmp_path / s.name) for s in shards], reader=reader))
    err = info.value
    assert (err.key, err.reason) == (key, reason)
    assert err.source.endswith("bad-000000.tar") and f"key {key!r}" in str(err)
    assert not marker.exists()


def shard_cases() -> list[tuple[str, str, str]]:
    return [(modality, kind, reader) for modality in LOADERS for kind, reader in READERS]


@pytest.mark.parametrize("modality, kind, reader", shard_cases())
@pytest.mark.backend
def test_raise_on_a_bad_shard_names_it_and_the_reason(tmp_path, modality, kind, reader):
    marker = tmp_path / "unpickled"
    corpus = (build_made if kind == "made" else build_foreign)(tmp_path, modality, marker)
    good = [s for s in sorted(corpus.folder.glob("*.tar")) if s.name.startswith(("good", "fg"))]
    for case in corpus.shard_cases:
        urls = [str(good[0]), str(corpus.folder / case.name)]
        if not case.expect[reader]:  # read whole: the good shard's samples and all of its own
            read = set(one_pass(LOADERS[modality](urls, reader=reader)))
            assert len(read) == len(corpus.good_keys) + case.samples, case.name
            continue
        with pytest.raises(DataError) as info:  # DALI's reader refuses some at build time
            one_pass(LOADERS[modality](urls, reader=reader))
        assert info.value.source.endswith(case.name), (case.name, str(info.value))
        assert info.value.reason in case.expect[reader], (case.name, str(info.value))
    assert not marker.exists()
    assert not list(tmp_path.rglob("shardflow-evil*"))


@pytest.mark.parametrize("modality", list(LOADERS))
@pytest.mark.backend
def test_a_fifo_in_place_of_a_shard_or_index_is_never_opened(tmp_path, modality):
    """Opening a FIFO blocks until a writer comes: a FIFO shard is refused before any read,
    and a FIFO where the .idx belongs sends the shard to the streaming reader."""
    with deadline(120):  # a regression would block in open(): fail, not hang the suite
        _fifos_are_never_opened(tmp_path, modality)


def _fifos_are_never_opened(tmp_path: Path, modality: str) -> None:
    info = _written(tmp_path, "good", _goods(modality, "good", 3))
    os.mkfifo(tmp_path / "good-000001.tar")
    with pytest.raises(ValueError, match="not regular files.*good-000001.tar"):
        LOADERS[modality]([str(tmp_path / info.name), str(tmp_path / "good-000001.tar")],
                          on_error="skip")
    (tmp_path / info.name.replace(".tar", ".idx")).unlink()
    os.mkfifo(tmp_path / info.name.replace(".tar", ".idx"))
    loader = LOADERS[modality]([str(tmp_path / info.name)])
    assert loader.reader == "stream" and set(one_pass(loader)) == {"good0", "good1", "good2"}


# -- where each category of BAD_INPUTS.md is tested ----------------------------------------------

CORPUS = "test_corpus::test_skip_names_every_bad_input_and_read_plus_skipped_is_total"
RAISE_SAMPLE = "test_corpus::test_raise_on_a_bad_sample_names_shard_key_and_reason"
RAISE_SHARD = "test_corpus::test_raise_on_a_bad_shard_names_it_and_the_reason"
TOOLS = "test_bad_inputs_shards::"
CATEGORIES: dict[str, list[str]] = {
    "shards: truncated, zero-byte, HTML page": [
        CORPUS, RAISE_SHARD, TOOLS + "test_iter_samples_shard_damage_names_shard_and_reason",
        TOOLS + "test_make_shards_skip_over_every_bad_shard",
        TOOLS + "test_make_shards_raise_stops_at_bad_shard",
        TOOLS + "test_verify_shards_names_every_bad_shard"],
    "shards: missing shard, brace typo (one pre-flight error)": [
        TOOLS + "test_missing_shards_one_preflight_error_listing_all",
        TOOLS + "test_verify_lists_every_missing_shard",
        "test_image_loader::test_missing_shards_are_listed_together",
        "test_urls::test_brace_typos_are_named"],
    "shards: a key twice, a key's members apart": [
        CORPUS, RAISE_SHARD, TOOLS + "test_iter_samples_key_seen_twice",
        TOOLS + "test_split_key_fragment_is_not_converted_alone",
        "test_make_shards::test_verify_finds_a_key_in_two_shards"],
    "shards: absurd member size, a compressed member without bound": [
        CORPUS, RAISE_SHARD, TOOLS + "test_absurd_member_size_refused_without_allocating",
        TOOLS + "test_absurd_member_size_under_skip_does_not_hang",
        TOOLS + "test_gzip_shard_read_and_gz_member_expanded_within_the_limit"],
    "shards: ../, absolute names, links, devices never used as paths": [
        CORPUS, RAISE_SHARD, TOOLS + "test_iter_samples_refuses_links_devices_and_escaping_names"],
    "shards: fewer shards than ranks": [
        "test_image_loader::test_more_ranks_than_shards_is_an_error_at_build",
        "test_verify_split::test_a_split_the_loaders_would_refuse_is_a_warning_and_workers_are_gone"],
    "added: a FIFO or device where a shard, index or input file belongs": [
        "test_corpus::test_a_fifo_in_place_of_a_shard_or_index_is_never_opened",
        TOOLS + "test_fifos_and_devices_are_refused_never_opened"],
    "added: a shard replaced after indexing (stale .idx)": [CORPUS, RAISE_SHARD],
    "samples: a required field missing": [
        CORPUS, RAISE_SAMPLE, TOOLS + "test_manifest_row_without_label_is_named",
        TOOLS + "test_verify_flags_bad_labels_and_missing_fields",
        "test_tabular_convert::test_bad_rows_skipped_are_counted_per_reason_with_their_lines"],
    "samples: label out of range or not a number (also 1_0, non-ASCII digits, > int64)": [
        CORPUS, RAISE_SAMPLE, TOOLS + "test_verify_flags_bad_labels_and_missing_fields",
        TOOLS + "test_manifest_integer_labels_with_a_bad_one_are_not_renumbered",
        "test_tabular_convert::test_bad_rows_raise_naming_file_and_line"],
    "samples: .pyd/.pkl/.pickle/.pth never unpickled": [
        CORPUS, TOOLS + "test_iter_samples_never_unpickles",
        TOOLS + "test_payload_would_run_if_unpickled"],
    "samples: .npy with object dtype refused": [
        CORPUS, RAISE_SAMPLE, "test_pointcloud_io::test_object_npy_refused_without_unpickling",
        TOOLS + "test_pointcloud_skip_each_bad_cloud",
        "test_tabular_convert::test_blocks_are_deterministic_and_refuse_what_they_are_not"],
    "images: truncated, corrupt, random bytes": [
        CORPUS, RAISE_SAMPLE, TOOLS + "test_images_skip_bad_keep_odd_but_valid",
        "test_image_loader::test_corrupt_jpeg_raises_naming_shard_and_key_or_is_skipped"],
    "images: decompression bomb rejected before allocation": [
        CORPUS, RAISE_SAMPLE, TOOLS + "test_decompression_bomb_rejected_before_allocation"],
    "images: tiny, thin, grayscale, alpha, CMYK, 16-bit give RGB uint8": [
        CORPUS, TOOLS + "test_images_skip_bad_keep_odd_but_valid"],
    "text: invalid UTF-8, NUL, empty, one enormous document": [
        CORPUS, RAISE_SAMPLE, TOOLS + "test_text_skip_each_bad_document",
        "test_text_loader::test_an_enormous_document_is_truncated_with_a_warning"],
    "point clouds: NaN/Inf, 0/1 point, identical, too many, wrong dtype or shape": [
        CORPUS, RAISE_SAMPLE, TOOLS + "test_pointcloud_skip_each_bad_cloud",
        "test_pointcloud_io::test_npy_huge_declared_shape_refused_before_allocation"],
    "config: invalid values, unknown options name the option": [
        "test_image_loader::test_invalid_options_name_the_option",
        "test_image_loader::test_unknown_option_is_refused",
        "test_trainers::test_invalid_options_are_named",
        "test_make_shards::test_invalid_options_are_named",
        TOOLS + "test_zero_limits_are_refused_naming_the_option",
        "test_faults::test_worker_timeout_must_be_positive"],
    "config: an output folder with shards refused unless --overwrite": [
        TOOLS + "test_out_with_shards_refused_unless_overwrite",
        "test_make_shards::test_refuses_existing_shards_unless_overwrite"],
    "urls: pipe: refused unless allowed": [
        "test_urls::test_pipe_urls_refused_unless_allowed",
        TOOLS + "test_pipe_url_refused_without_running_it"],
    "urls: credentials never in logs, errors, reports, checkpoints": [
        "test_credentials::test_loaders_never_show_url_secrets",
        "test_credentials::test_tools_never_show_url_secrets",
        "test_trainers::test_credentials_in_the_data_url_appear_nowhere_in_the_run"],
    "checkpoints: a pickle payload refused, no fallback": [
        "test_trainers::test_checkpoint_with_a_pickled_object_is_refused"],
    "checkpoints: truncated one named, the previous used": [
        "test_trainers::test_corrupt_newest_checkpoint_is_named_and_the_previous_used"],
    "checkpoints: another model or dataset refused with what differs": [
        "test_trainers::test_checkpoint_of_another_model_is_refused_with_what_differs",
        "test_trainers::test_checkpoint_of_another_dataset_is_refused"],
    "faults: killed at random steps, each sample once (1 and 2 ranks, both readers)": [
        "test_kills::test_killed_at_random_steps_each_sample_is_seen_once",
        "test_trainers::test_sigkill_then_rerun_finishes_and_sees_each_sample_once"],
    "faults: killed while writing, disk full: no partial file, a rerun finishes": [
        "test_atomic::test_killed_conversion_leaves_no_partial_file_and_rerun_finishes",
        "test_atomic::test_full_disk_leaves_no_partial_file_and_rerun_with_space_finishes",
        "test_trainers::test_full_disk_while_saving_leaves_the_previous_checkpoint_and_rerun_finishes"],
    "faults: a dropped connection mid-shard (retries, then named or counted)": [
        "test_image_loader::test_a_dropped_download_is_resumed_and_nothing_is_lost",
        "test_image_loader::test_streaming_ranks_stay_in_step_when_a_shard_breaks",
        "test_credentials::test_loaders_never_show_url_secrets"],
    "faults: a worker that hangs or dies is named within a timeout": [
        "test_image_loader::test_a_hung_reader_is_reported_within_the_timeout",
        "test_faults::test_a_hung_worker_is_named_within_the_timeout",
        "test_faults::test_a_killed_worker_is_named_and_the_run_ends"],
    # -- odd but valid: read correctly, or repaired at conversion and counted -----------------
    "odd JPEGs (junk before SOI, short APP14, FF00, CMYK, progressive, MPO, PNG named .jpg)": [
        "test_realworld_convert::test_the_strict_rule_matches_what_dali_and_the_header_parser_refuse",
        "test_realworld_convert::test_make_shards_repairs_counts_and_the_loader_reads_every_sample",
        "test_realworld_convert::test_verify_reports_what_the_loader_refuses_and_resharding_repairs_it"],
    "EXIF orientation 2-8 comes out upright (and an option turns it off)": [
        "test_realworld_images::test_photos_come_out_upright_on_both_cpu_paths",
        "test_realworld_images::test_exif_orientation_off_gives_the_stored_frame"],
    "tars from GNU tar, Python's tarfile, webdataset's writers; gzip shards and .gz members": [
        "test_foreign_shards::test_gnu_tar_folder_entries_are_passed_over_and_keys_follow_webdataset",
        "test_foreign_shards::test_webdataset_shard_writer_and_compressed_tar_writer_shards_are_read",
        "test_foreign_shards::test_tgz_and_tar_gz_in_a_folder_go_to_the_streaming_reader",
        "test_foreign_shards::test_gz_members_are_expanded_and_lose_the_suffix"],
    "image-only and caption shards; labelled shards without a class map": [
        "test_realworld_images::test_caption_shards_read_without_labels_with_text_and_json",
        "test_realworld_convert::test_train_takes_classes_from_label_statistics_or_num_classes"],
    "keys containing dots: the cause named, read + skipped == total": [
        "test_foreign_shards::test_dotted_keys_are_named_and_counted_in_samples"],
    "a tokenizer.json without a pad token (GPT-2 style) for causal LM": [
        "test_realworld_convert::test_gpt2_style_tokenizer_reads_for_clm_and_pads_with_end_of_text"],
    "point clouds in geographic coordinates: no silent precision loss": [
        "test_realworld_convert::test_geographic_clouds_keep_their_precision_and_plain_ones_are_unchanged",
        "test_pointcloud_loader::test_geographic_float64_clouds_from_other_tools_keep_their_precision"],
    "a LiDAR frame whose label count differs from its points, NaN points, a bad label": [
        "test_scene_loader::test_bad_scenes_are_named_and_skipped",
        "test_dataset::test_scene_labels_agree_with_the_loader"],
    "added: random access (ShardDataset) and the loader agree on clouds, offsets, reasons": [
        "test_dataset::test_point_clouds_and_their_offsets_agree_with_the_loader",
        "test_dataset::test_scene_labels_agree_with_the_loader"],
    "added: a LiDAR frame with no point within crop_range (never a scene of 0 points)": [
        "test_scene_loader::test_a_frame_with_no_point_in_crop_range_is_a_counted_skip"],
    "added: a PLY header comment naming end_header (the body starts after the real line)": [
        "test_pointcloud_io::test_ply_comment_naming_end_header_is_not_the_end"],
    "an epoch in which every sample was skipped is an error, never a silent empty epoch": [
        "test_realworld_images::test_an_epoch_in_which_every_sample_was_skipped_is_an_error"],
}


def test_every_category_names_tests_that_exist():
    for category, tests in CATEGORIES.items():
        assert tests, category
        for ref in tests:
            module, name = ref.split("::")
            assert callable(getattr(importlib.import_module(module), name, None)), \
                f"{category}: {ref} does not exist"


def test_label_parsing_and_the_sample_count_an_error_carries():
    assert [check_label(b) for b in (b"+1", b"0001", b" 9223372036854775807\n")] == \
        [1, 1, 2**63 - 1]
    for data, reason in ((b"9223372036854775808", "label-out-of-range"), (b"1_0", "bad-label"),
                         (b"1" * 100, "bad-label"), ("\u0661".encode(), "bad-label")):
        with pytest.raises(DataError) as info:
            check_label(data)
        assert info.value.reason == reason, data
    # a whole file: unknown until a key makes it one sample; a count given stays
    assert DataError("r", "d").samples is None
    assert DataError("r", "d").located(key="k").samples == 1
    assert DataError("r", "d", samples=None).located(key="k").samples is None
    assert pickle.loads(pickle.dumps(DataError("r", "d"))).located(key="k").samples == 1
    assert pickle.loads(pickle.dumps(DataError("r", "d", samples=7))).samples == 7


@pytest.mark.dali  # the index check of DALI's reader
@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_the_index_check_accepts_long_and_non_ascii_member_names(tmp_path, fmt):
    """Names the ustar header cannot hold live in PAX or GNU long-name records: a shard and
    an index written by other tools (webdataset's TarWriter writes PAX) are read, not refused."""
    names = ["caf\u00e9.jpg", "caf\u00e9.cls", "\u00e9" * 60 + ".jpg", "\u00e9" * 60 + ".cls",
             "k" * 120 + ".jpg", "k" * 120 + ".cls"]
    shard = tmp_path / "other-000000.tar"
    with tarfile.open(shard, "w", format=fmt) as tar:
        for i, name in enumerate(names):
            data = jpeg_bytes(i, (20, 16)) if name.endswith("jpg") else b"1"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(shard) as tar:
        members = [(m.name.rsplit(".", 1)[1], m.offset_data, m.size, m.name) for m in tar]
    (tmp_path / "other-000000.idx").write_text(
        format_index([members[i:i + 2] for i in range(0, len(members), 2)]))
    assert check_local_shard(str(shard)) == 3
    loader = LOADERS["image"]([str(shard)], reader="dali")
    assert len(set(one_pass(loader))) == 3
