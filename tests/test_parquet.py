"""make_shards' parquet kind: plain bytes and Hugging Face struct image columns, int and string
labels, text, folders of files; read back by the loaders; reruns, resumes, parts; bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import convert_killed, jpeg_bytes, load_manifest, read_wds, run_tool, shard_paths

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from shardflow import image_loader, text_loader  # noqa: E402
from shardflow.convert import ConvertConfig, convert, parquet, parquet_rows  # noqa: E402
from shardflow.convert.parquet import ParquetOptions  # noqa: E402


def images(n: int, seed: int = 0) -> list[bytes]:
    """JPEG, with every third a PNG (stored as .png: members are named by the real format)."""
    return [jpeg_bytes(seed + i, size=(24, 16), fmt="PNG" if i % 3 == 2 else "JPEG")
            for i in range(n)]


def hf_struct(data: list[bytes | None], paths: list[str | None] | None = None) -> pa.Array:
    """An image column as Hugging Face's Image feature writes it: struct<bytes, path>."""
    paths = paths or [f"img{i}.jpg" for i in range(len(data))]
    return pa.StructArray.from_arrays(
        [pa.array(data, pa.binary()), pa.array(paths, pa.string())], names=["bytes", "path"])


def hf_metadata(label_names: list[str] | None = None) -> dict[bytes, bytes]:
    features: dict[str, object] = {"image": {"_type": "Image"}}
    if label_names is not None:
        features["label"] = {"names": label_names, "_type": "ClassLabel"}
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def write(path: Path, columns: dict[str, object], *, metadata: dict[bytes, bytes] | None = None,
          row_group_size: int = 4) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(columns)
    if metadata:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def make_shards(src: Path, out: Path, *args: object, check: bool = True):
    return run_tool("make_shards", "parquet", src, out, "--quiet", *args, check=check)


def members(sample: dict) -> list[str]:
    return sorted(k for k in sample if not k.startswith("__"))


def image_of(sample: dict) -> bytes:
    return sample.get("jpg", sample.get("png"))


def loader_labels(out: Path, **kw: object) -> dict[str, int]:
    """{key: label} over one epoch of the image loader on the CPU, each key once."""
    seen: dict[str, int] = {}
    with image_loader(str(out), batch_size=4, train=False, device="cpu", size=16,
                      **kw) as loader:
        for batch in loader:
            assert batch.image.shape[1:] in ((3, 16, 16), (16, 16, 3))
            for key, label in zip(batch.keys, batch.label.tolist(), strict=True):
                assert key not in seen
                seen[key] = label
    return seen


# -- round trips -------------------------------------------------------------------------------

def test_bytes_column_with_int_labels_round_trips_through_the_image_loader(tmp_path):
    data = images(11)
    src = write(tmp_path / "plain.parquet", {"img": pa.array(data, pa.binary()),
                                             "y": pa.array([i % 4 for i in range(11)],
                                                           pa.int32())})
    out = tmp_path / "out"
    make_shards(src, out, "--image-column", "img", "--label-column", "y", "--max-count", 4,
                "--workers", 2)
    m = load_manifest(out)
    assert m["modality"] == "image" and m["total_samples"] == 11 and m["classes"] is None
    assert [s["samples"] for s in m["shards"]] == [4, 4, 3]
    samples = read_wds(out)
    assert [s["__key__"] for s in samples] == [f"plain_{i:08d}" for i in range(11)]
    for i, sample in enumerate(samples):
        assert members(sample) == ["cls", "png" if i % 3 == 2 else "jpg"]
        assert image_of(sample) == data[i]  # the original bytes
        assert int(sample["cls"]) == i % 4
    assert loader_labels(out) == {f"plain_{i:08d}": i % 4 for i in range(11)}


def test_hf_folder_of_two_files_with_struct_images_and_string_labels(tmp_path):
    root = tmp_path / "hf"
    names = ["zebra", "cat", "dog"]
    data = images(13)
    for n, rows in enumerate((range(0, 7), range(7, 13))):
        write(root / "data" / f"train-{n:05d}-of-00002.parquet",
              {"image": hf_struct([data[i] for i in rows]),
               "label": [names[i % 3] for i in rows]}, metadata=hf_metadata())
    (root / "README.md").write_text("# a dataset card\n")
    out = tmp_path / "out"
    make_shards(root, out, "--image-column", "image", "--label-column", "label",
                "--max-count", 5)
    m = load_manifest(out)
    classes = {"cat": 0, "dog": 1, "zebra": 2}  # sorted distinct values
    assert m["classes"] == classes and m["total_samples"] == 13
    assert m["ignored"] == [{"source": str(root / "README.md"), "reason": "not-a-parquet-file"}]
    keys = [f"data_train-00000-of-00002_{i:08d}" for i in range(7)] + \
        [f"data_train-00001-of-00002_{i:08d}" for i in range(6)]
    samples = read_wds(out)
    assert [s["__key__"] for s in samples] == keys
    assert [image_of(s) for s in samples] == data
    assert [int(s["cls"]) for s in samples] == [classes[names[i % 3]] for i in range(13)]
    assert loader_labels(out) == {k: classes[names[i % 3]] for i, k in enumerate(keys)}


def test_a_glob_pattern_picks_one_split_of_a_folder(tmp_path):
    for split, n in (("train", 3), ("test", 2)):
        write(tmp_path / "hf" / "data" / f"{split}-00000-of-00001.parquet",
              {"text": [f"{split} {i}" for i in range(n)]})
    out = tmp_path / "out"
    make_shards(tmp_path / "hf" / "data" / "train-*.parquet", out, "--text-column", "text")
    assert [(s["__key__"], s["txt"]) for s in read_wds(out)] == [
        (f"train-00000-of-00001_{i:08d}", f"train {i}".encode()) for i in range(3)]


def test_hf_class_label_names_become_the_class_map(tmp_path):
    names = ["airplane", "bird", "cat"]
    src = write(tmp_path / "t.parquet", {"image": hf_struct(images(4)),
                                         "label": pa.array([2, 0, 1, 2], pa.int64())},
                metadata=hf_metadata(names))
    make_shards(src, tmp_path / "out", "--image-column", "image", "--label-column", "label")
    m = load_manifest(tmp_path / "out")
    assert m["classes"] == {"airplane": 0, "bird": 1, "cat": 2}
    assert [int(s["cls"]) for s in read_wds(tmp_path / "out")] == [2, 0, 1, 2]


def test_string_labels_follow_classes_from_an_earlier_conversion(tmp_path):
    train = write(tmp_path / "train.parquet", {"image": hf_struct(images(3)),
                                               "label": ["b", "a", "c"]})
    val = write(tmp_path / "val.parquet", {"image": hf_struct(images(2)), "label": ["c", "c"]})
    make_shards(train, tmp_path / "t", "--image-column", "image", "--label-column", "label")
    make_shards(val, tmp_path / "v", "--image-column", "image", "--label-column", "label",
                "--classes-from", tmp_path / "t" / "manifest.json")
    assert load_manifest(tmp_path / "v")["classes"] == {"a": 0, "b": 1, "c": 2}
    assert [int(s["cls"]) for s in read_wds(tmp_path / "v")] == [2, 2]
    other = write(tmp_path / "other.parquet", {"image": hf_struct(images(1)), "label": ["zz"]})
    refused = make_shards(other, tmp_path / "o", "--image-column", "image", "--label-column",
                          "label", "--classes-from", tmp_path / "t" / "manifest.json",
                          check=False)
    assert refused.returncode == 2 and "'zz'" in refused.stderr


def test_text_column_round_trips_through_the_text_loader(tmp_path):
    docs = [f"document {i}: naïve café " + "x" * i for i in range(9)]
    src = write(tmp_path / "corpus.parquet", {"id": list(range(9)), "text": docs},
                row_group_size=3)
    out = tmp_path / "out"
    make_shards(src, out, "--text-column", "text", "--max-count", 4)
    m = load_manifest(out)
    assert m["modality"] == "text" and m["total_samples"] == 9
    samples = read_wds(out)
    assert [members(s) for s in samples] == [["txt"]] * 9
    assert [s["txt"].decode() for s in samples] == docs
    seen: dict[str, bytes] = {}
    with text_loader(str(out), batch_size=1, seq_len=128, packing=False, device="cpu") as ld:
        for batch in ld:
            (key,) = batch.keys
            assert key not in seen
            seen[key] = bytes(int(t) for t in batch.input_ids[0] if t < 256)
    assert seen == {f"corpus_{i:08d}": d.encode() for i, d in enumerate(docs)}


def test_image_and_caption_columns_make_captioned_image_samples(tmp_path):
    data = images(5)
    src = write(tmp_path / "cap.parquet", {"image": hf_struct(data),
                                           "caption": [f"a photo {i}" for i in range(5)]})
    out = tmp_path / "out"
    make_shards(src, out, "--image-column", "image", "--text-column", "caption")
    assert load_manifest(out)["modality"] == "image"
    samples = read_wds(out)
    assert [image_of(s) for s in samples] == data
    assert [s["txt"] for s in samples] == [f"a photo {i}".encode() for i in range(5)]
    captions: dict[str, str] = {}
    with image_loader(str(out), batch_size=5, train=False, device="cpu", size=16, labels=False,
                      extras=("txt",)) as loader:
        for batch in loader:
            captions.update(zip(batch.keys, batch.extras["txt"], strict=True))
    assert captions == {f"cap_{i:08d}": f"a photo {i}" for i in range(5)}


def test_key_column_names_samples_and_repeats_are_bad_rows(tmp_path):
    src = write(tmp_path / "k.parquet", {"text": [f"doc {i}" for i in range(5)],
                                         "id": ["a.1", "b/2", "a.1", None, "c 3"]})
    out = tmp_path / "out"
    make_shards(src, out, "--text-column", "text", "--key-column", "id", "--on-error", "skip")
    assert [s["__key__"] for s in read_wds(out)] == ["a_1", "b_2", "c_3"]
    m = load_manifest(out)
    assert m["skipped_counts"] == {"duplicate-key": 1, "missing-key": 1}
    dup = next(e for e in m["skipped"] if e["reason"] == "duplicate-key")
    assert dup["source"] == f"{src} row 2" and f"{src} row 0" in dup["detail"]


# -- the guarantees: determinism, resume, parts, bounded reads ----------------------------------

def test_rerun_gives_byte_identical_shards_whatever_the_workers(tmp_path):
    src = write(tmp_path / "d.parquet", {"image": hf_struct(images(10)),
                                         "label": [i % 2 for i in range(10)]}, row_group_size=3)
    runs = {}
    for name, workers, seed in (("a", 1, None), ("b", 2, None), ("s1", 2, 5), ("s2", 1, 5)):
        extra = ["--shuffle-seed", seed] if seed is not None else []
        make_shards(src, tmp_path / name, "--image-column", "image", "--label-column", "label",
                    "--max-count", 3, "--workers", workers, *extra)
        runs[name] = [(p.read_bytes(), p.with_suffix(".idx").read_bytes())
                      for p in shard_paths(tmp_path / name)]
    assert runs["a"] == runs["b"] and runs["s1"] == runs["s2"]
    plain = [s["__key__"] for s in read_wds(tmp_path / "a")]
    mixed = [s["__key__"] for s in read_wds(tmp_path / "s1")]
    assert mixed != plain and sorted(mixed) == plain


@pytest.mark.parametrize("seed", [None, 7])
def test_an_interrupted_conversion_resumes_to_the_same_shards(tmp_path, monkeypatch, seed):
    """Killed (SIGKILL, in a child process) after 15 samples, then the same conversion again."""
    monkeypatch.setattr(parquet, "CHUNK_ROWS", 3)  # chunks inside row groups, and across
    monkeypatch.setattr(parquet, "SHUFFLE_ROWS", 8)
    patches = {f"{parquet.__name__}.CHUNK_ROWS": 3, f"{parquet.__name__}.SHUFFLE_ROWS": 8}
    texts = [f"text {i}" if i % 11 else "" for i in range(40)]  # some bad rows, skipped
    write(tmp_path / "src" / "a.parquet", {"t": texts[:23]}, row_group_size=5)
    write(tmp_path / "src" / "b.parquet", {"t": texts[23:]}, row_group_size=7)

    def config(out: Path) -> ConvertConfig:
        return ConvertConfig(kind="parquet", src=str(tmp_path / "src"), out=out, max_count=4,
                             workers=1, on_error="skip", shuffle_seed=seed,
                             parquet=ParquetOptions(text_column="t"))

    whole = convert(config(tmp_path / "whole"))
    assert whole.total_samples == 36 and whole.to_json()["skipped_counts"] == {"empty-text": 4}
    convert_killed(config(tmp_path / "out"), 15, tmp_path, patches)
    assert (tmp_path / "out" / ".make_shards.journal.json").exists()
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert len(list((tmp_path / "out").glob("*.tar"))) == 3  # finished shards only
    resumed = convert(config(tmp_path / "out"))
    assert resumed.to_json()["skipped"] == whole.to_json()["skipped"]
    for a, b in zip(shard_paths(tmp_path / "whole"), shard_paths(tmp_path / "out"), strict=True):
        assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("seed", [None, 3])
@pytest.mark.parametrize("part", [(0, 1), (1, 2)])
def test_the_task_stream_seeks_to_any_position_exactly(tmp_path, monkeypatch, seed, part):
    """What a resumed run reads from task n on is what a whole run reads there."""
    monkeypatch.setattr(parquet, "CHUNK_ROWS", 3)
    monkeypatch.setattr(parquet, "SHUFFLE_ROWS", 7)
    write(tmp_path / "a.parquet", {"t": [f"a{i}" for i in range(13)]}, row_group_size=5)
    (tmp_path / "b.parquet").write_bytes(b"not parquet")
    write(tmp_path / "c.parquet", {"t": [f"c{i}" for i in range(9)]}, row_group_size=4)
    plan = parquet.plan_parquet(tmp_path, ParquetOptions(text_column="t"))

    def stream(start: int) -> list[str]:
        return [repr(t) if isinstance(t, parquet_rows.RowChunk) else str(t)
                for t in parquet_rows.row_tasks(plan, part, seed, start)]

    whole = stream(0)
    assert len(whole) > 4
    for n in range(len(whole) + 1):
        assert stream(n) == whole[n:], n


def test_parts_then_merge_hold_every_row_once(tmp_path):
    for n in range(2):
        write(tmp_path / "src" / f"p{n}.parquet",
              {"text": [f"file {n} doc {i}" for i in range(7 + n)]}, row_group_size=3)
    out = tmp_path / "parts"
    for i in range(3):
        make_shards(tmp_path / "src", out, "--text-column", "text", "--part", f"{i}/3",
                    "--max-count", 2)
    run_tool("make_shards", "merge", out, check=True)
    docs = [s["txt"].decode() for s in read_wds(out)]
    assert load_manifest(out)["total_samples"] == 15
    assert docs == [f"file {n} doc {i}" for n in range(2) for i in range(7 + n)]


def test_rows_are_read_in_batches_never_a_whole_file(tmp_path, monkeypatch):
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a whole file or row group was read at once")

    for name in ("read_table", "ParquetFile.read", "ParquetFile.read_row_group",
                 "ParquetFile.read_row_groups"):
        owner, _, attr = name.rpartition(".")
        monkeypatch.setattr(getattr(pq, owner) if owner else pq, attr, refuse)
    monkeypatch.setattr(parquet, "CHUNK_ROWS", 2)
    src = write(tmp_path / "t.parquet", {"t": [f"row {i}" for i in range(9)],
                                         "label": ["x", "y", "x"] * 3}, row_group_size=4)
    m = convert(ConvertConfig(kind="parquet", src=str(src), out=tmp_path / "o", workers=1,
                              parquet=ParquetOptions(text_column="t", label_column="label")))
    assert m.total_samples == 9 and m.classes == {"x": 0, "y": 1}


# -- bad input -------------------------------------------------------------------------------

def bad_rows_file(tmp_path: Path) -> Path:
    good = images(6)
    data = [good[0], None, b"\xff\xd8 not really a jpeg", good[3], good[4], good[5]]
    return write(tmp_path / "bad.parquet", {
        "image": hf_struct(data, [None, "elsewhere.jpg", None, None, None, None]),
        "caption": ["one", "two", "three", "", "five", "six"],
        "label": pa.array([0, 1, 2, 3, None, 5], pa.int64())})


BAD_ROWS = {1: "missing-image", 2: "bad-image", 3: "empty-text", 4: "missing-label"}


def test_bad_rows_raise_naming_file_and_row(tmp_path):
    src = bad_rows_file(tmp_path)
    proc = make_shards(src, tmp_path / "out", "--image-column", "image", "--text-column",
                       "caption", "--label-column", "label", "--workers", 1, check=False)
    assert proc.returncode == 1
    assert f"{src} row 1" in proc.stderr and "missing-image" in proc.stderr
    assert "--on-error skip" in proc.stderr


def test_bad_rows_skipped_are_counted_per_reason(tmp_path):
    src = bad_rows_file(tmp_path)
    out = tmp_path / "out"
    make_shards(src, out, "--image-column", "image", "--text-column", "caption",
                "--label-column", "label", "--on-error", "skip", "--workers", 2)
    m = load_manifest(out)
    assert m["total_samples"] == 2
    assert m["skipped_counts"] == {reason: 1 for reason in BAD_ROWS.values()}
    assert {e["source"]: e["reason"] for e in m["skipped"]} == \
        {f"{src} row {row}": reason for row, reason in BAD_ROWS.items()}
    assert [s["__key__"] for s in read_wds(out)] == ["bad_00000000", "bad_00000005"]


def test_unreadable_parquet_file_is_one_bad_input(tmp_path):
    write(tmp_path / "src" / "a.parquet", {"t": ["one", "two"]})
    (tmp_path / "src" / "b.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    failed = make_shards(tmp_path / "src", tmp_path / "o1", "--text-column", "t", check=False)
    assert failed.returncode == 1 and "b.parquet" in failed.stderr
    assert "bad-parquet" in failed.stderr
    make_shards(tmp_path / "src", tmp_path / "o2", "--text-column", "t", "--on-error", "skip")
    m = load_manifest(tmp_path / "o2")
    assert m["total_samples"] == 2 and m["skipped_counts"] == {"bad-parquet": 1}
    assert m["skipped"][0]["samples"] is None  # how many rows it held is unknown


def test_a_row_group_that_does_not_read_is_counted_and_the_others_converted(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(parquet, "CHUNK_ROWS", 4)
    src = tmp_path / "c.parquet"
    pq.write_table(pa.table({"t": [f"document {i} " * 20 for i in range(40)]}), src,
                   row_group_size=10, compression="snappy", use_dictionary=False)
    offset = pq.ParquetFile(src).metadata.row_group(1).column(0).data_page_offset
    data = bytearray(src.read_bytes())
    data[offset:offset + 30] = b"\xff" * 30  # row group 1's page header
    src.write_bytes(bytes(data))
    m = convert(ConvertConfig(kind="parquet", src=str(src), out=tmp_path / "o", workers=1,
                              on_error="skip", parquet=ParquetOptions(text_column="t")))
    assert m.total_samples == 30
    assert [(e["source"], e["reason"], e["samples"]) for e in m.skipped] == [
        (f"{src} rows 10..13", "bad-parquet", 4), (f"{src} rows 14..17", "bad-parquet", 4),
        (f"{src} rows 18..19", "bad-parquet", 2)]
    keys = [s["__key__"] for s in read_wds(tmp_path / "o")]
    assert keys == [f"c_{i:08d}" for i in range(40) if not 10 <= i < 20]


@pytest.mark.parametrize("args, expected", [
    (["--image-column", "picture"], ["'picture'", "'image'", "'label'", "'caption'"]),
    (["--image-column", "image", "--label-column", "lbl"], ["'lbl'", "'label'"]),
    (["--text-column", "label"], ["'label'", "string"]),
    (["--image-column", "caption"], ["'caption'", "binary"]),
    ([], ["--image-column", "--text-column"]),
])
def test_a_wrong_column_is_a_clear_usage_error(tmp_path, args, expected):
    src = write(tmp_path / "t.parquet", {"image": hf_struct(images(2)), "label": [0, 1],
                                         "caption": ["a", "b"]})
    proc = make_shards(src, tmp_path / "out", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert all(text in proc.stderr for text in expected), proc.stderr
