"""The tabular loader: feature hashing (pinned ids, the numpy path equal to the plain-Python
reference, collisions as predicted), dense transforms, and over real shards: every row once
per epoch with the values the source holds, exact resume mid-epoch, disjoint ranks, skips,
len(), the per-field bucket counts, both readers and both backends."""

from __future__ import annotations

import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import copier_outputs, not_delivered

from shardflow import tabular_loader
from shardflow.convert import ConvertConfig, convert
from shardflow.convert.tabular import TabularOptions
from shardflow.errors import DataError
from shardflow.loading.holdout import KeyHoldout
from shardflow.samples.tabular_block import Block, encode_block, pack_values
from shardflow.shards.writer import ShardWriter
from shardflow.tabular import dense, hashing

# -- hashing ---------------------------------------------------------------------------------

def ids_of(values: list[bytes], seed: int, buckets: int) -> list[int]:
    """The numpy path over one field of `values`."""
    offsets, blob = pack_values([values])
    return hashing.bucket_ids(blob, offsets, len(values), np.array([buckets]),
                              np.array([seed], np.uint64))[:, 0].tolist()


def test_hashed_ids_are_pinned():
    """Fixed ids for fixed values: a change of the hash (which would silently remap every
    trained embedding) fails here. Bump hashing.HASH_VERSION with any change."""
    seeds = hashing.field_seeds(0, 2)
    assert [int(s) for s in seeds] == [16294208416658607535, 10451216379200822465]
    values = [b"68fd1e64", b"a", "日本".encode(), b"x" * 20, b"05db9164"]
    assert ids_of(values, int(seeds[0]), 2**18) == [27713, 82357, 19299, 129334, 90926]
    assert ids_of(values, int(seeds[1]), 2**18) == [146448, 202299, 60519, 123151, 142548]
    assert hashing.hash_value(b"68fd1e64", 0) == 503742475078868643
    assert hashing.HASH_VERSION == 1


def test_numpy_path_equals_the_plain_python_reference():
    rng = np.random.default_rng(3)
    values = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()
              for n in rng.choice([0, 1, 5, 7, 8, 9, 15, 16, 17, 33, 300], 3000)]
    seed = int(hashing.field_seeds(11, 1)[0])
    for buckets in (2, 3, 1000, 2**32):
        got = ids_of(values, seed, buckets)
        assert got == [hashing.bucket_id(v, seed, buckets) for v in values]
        assert all((i == 0) == (not v) for i, v in zip(got, values, strict=True))
        assert max(got) < buckets


def test_collisions_are_about_as_many_as_predicted():
    rng = np.random.default_rng(0)
    distinct = {f"{v:016x}".encode() for v in rng.integers(0, 2**62, 20_000)}
    for buckets in (2**14, 2**16):
        ids = ids_of(sorted(distinct), 5, buckets)
        collided = len(distinct) - len(set(ids))
        expected = hashing.expected_collisions(len(distinct), buckets)
        assert abs(collided - expected) < 0.05 * expected + 30, (buckets, collided, expected)


def test_fields_hash_independently():
    values = [f"v{i}".encode() for i in range(5000)]
    seeds = hashing.field_seeds(0, 2)
    a, b = (ids_of(values, int(s), 2**20) for s in seeds)
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 5


def test_dense_transforms_fill_compress_and_clip():
    x = np.array([[np.nan, -3.0, 0.0, 1.0, 1000.0]], np.float32)
    np.testing.assert_allclose(dense.transform(x, "log1p", 0.0, None),
                               [[0.0, 0.0, 0.0, np.log(2), np.log(1001)]], rtol=1e-6)
    np.testing.assert_allclose(dense.transform(x, "signed_log", -1.0, None),
                               [[-1.0, -np.log(4), 0.0, np.log(2), np.log(1001)]], rtol=1e-6)
    np.testing.assert_allclose(dense.transform(x, "none", 7.0, (-1.0, 10.0)),
                               [[7.0, -1.0, 0.0, 1.0, 10.0]])
    assert np.isnan(x[0, 0])  # the block's own array is left as read


# -- the loader over real shards ---------------------------------------------------------------

ROWS, PER_BLOCK = 320, 16


def criteo_lines(n: int) -> list[str]:
    rng = np.random.default_rng(1)
    lines = []
    for _ in range(n):
        counts = [str(int(v)) if rng.random() > 0.2 else "" for v in rng.integers(-2, 900, 13)]
        ids = [f"{int(v):08x}" if rng.random() > 0.1 else "" for v in rng.integers(0, 500, 26)]
        lines.append("\t".join([str(int(rng.integers(0, 2))), *counts, *ids]))
    return lines


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("tabular")
    lines = criteo_lines(ROWS)
    (root / "day.tsv").write_text("\n".join(lines) + "\n")
    convert(ConvertConfig(kind="tabular", src=str(root / "day.tsv"), out=root / "out",
                          workers=1, max_count=5,
                          tabular=TabularOptions(preset="criteo", rows_per_block=PER_BLOCK)))
    return root / "out", lines


def expected_row(line: str, buckets: int) -> tuple[float, list[float], list[int]]:
    """What the loader must give for a source line: log1p counts (0 for missing), ids."""
    fields = line.split("\t")
    seeds = hashing.field_seeds(0, 26)
    counts = [float(np.log1p(max(float(v), 0.0))) if v else 0.0 for v in fields[1:14]]
    ids = [hashing.bucket_id(v.encode(), int(seeds[f]), buckets)
           for f, v in enumerate(fields[14:])]
    return float(fields[0]), counts, ids


def line_of(key: str) -> int:
    """The 0-based source line of a row key "day_<first line:010d>:<row>"."""
    block, row = key.split(":")
    return int(block.rsplit("_", 1)[1]) - 1 + int(row)


def epoch(loader) -> list:
    return [b for b in loader]


@pytest.mark.parametrize("backend", ["dali", "portable"])
def test_every_row_once_per_epoch_with_the_source_values(shards, backend):
    out, lines = shards
    with tabular_loader(out, batch_size=48, num_buckets=1000, device="cpu", backend=backend,
                        shuffle_buffer=64) as loader:
        assert loader.schema.num_buckets == [1000] * 26 and len(loader.schema.dense) == 13
        assert loader.schema.rows == ROWS and len(loader) == 7
        first, second = epoch(loader), epoch(loader)
    keys = [k for b in first for k in b.keys]
    assert len(first) == 7 and sorted(keys) == sorted(k for b in second for k in b.keys)
    assert len(set(keys)) == ROWS and keys != [k for b in second for k in b.keys]
    assert sorted(line_of(k) for k in keys) == list(range(ROWS))
    batch = first[0]
    assert batch.dense.dtype == torch.float32 and batch.sparse.dtype == torch.int64
    assert batch.label.dtype == torch.float32 and tuple(batch.sparse.shape) == (48, 26)
    for b in first[:3]:
        for i, key in enumerate(b.keys):
            label, counts, ids = expected_row(lines[line_of(key)], 1000)
            assert b.label[i].item() == label and b.sparse[i].tolist() == ids
            np.testing.assert_allclose(b.dense[i].numpy(), counts, rtol=1e-6)


def test_evaluation_reads_rows_in_shard_order(shards):
    out, _ = shards
    with tabular_loader(out, batch_size=100, device="cpu", train=False) as loader:
        keys = [k for b in loader for k in b.keys]
    assert [line_of(k) for k in keys] == list(range(ROWS))


@pytest.mark.parametrize("reader", ["dali", "stream"])
@pytest.mark.parametrize("stop_after", [1, 4])
def test_resume_mid_epoch_continues_exactly(shards, reader, stop_after):
    out, _ = shards
    kw = {"batch_size": 40, "device": "cpu", "reader": reader, "shuffle_buffer": 48,
          "seed": 5}
    with tabular_loader(out, **kw) as loader:
        whole = epoch(loader) + epoch(loader)[:2]
    with tabular_loader(out, **kw) as loader:
        it = iter(loader)
        for _ in range(stop_after):
            next(it)
        it.close()
        state = loader.state_dict()
    with tabular_loader(out, **kw) as loader:
        loader.load_state_dict(state)
        rest = epoch(loader) + epoch(loader)[:2]
    assert len(rest) == len(whole) - stop_after
    for a, b in zip(whole[stop_after:], rest, strict=True):
        assert a.keys == b.keys
        assert torch.equal(a.dense, b.dense) and torch.equal(a.sparse, b.sparse)
        assert torch.equal(a.label, b.label)


def test_two_ranks_read_disjoint_rows_covering_the_source(shards):
    out, _ = shards
    keys = []
    for rank in range(2):
        with tabular_loader(out, batch_size=32, device="cpu", rank=rank, world_size=2) as loader:
            with pytest.raises(TypeError, match="one rank"):
                len(loader)
            keys.append({k for b in loader for k in b.keys})
    assert not keys[0] & keys[1] and len(keys[0] | keys[1]) == ROWS


def test_a_state_from_another_configuration_is_refused(shards):
    out, _ = shards
    with tabular_loader(out, batch_size=32, device="cpu") as loader:
        state = loader.state_dict()
    with tabular_loader(out, batch_size=32, device="cpu", num_buckets=2**10) as loader, \
            pytest.raises(ValueError, match="num_buckets"):
        loader.load_state_dict(state)


def test_bucket_counts_per_field(shards):
    out, _ = shards
    buckets = [2 + f for f in range(26)]
    with tabular_loader(out, batch_size=ROWS, device="cpu", num_buckets=buckets) as loader:
        assert loader.schema.num_buckets == buckets
        batch = next(iter(loader))
    assert (batch.sparse < torch.tensor(buckets)).all() and (batch.sparse >= 0).all()
    with pytest.raises(ValueError, match="26 categorical fields"):
        tabular_loader(out, batch_size=8, device="cpu", num_buckets=[10, 10])
    with pytest.raises(ValueError, match="num_buckets"):
        tabular_loader(out, batch_size=8, device="cpu", num_buckets=1)


def test_holdout_splits_by_block(shards):
    out, _ = shards
    sides = {}
    for side in ("train", "eval"):
        with tabular_loader(out, batch_size=64, device="cpu") as loader:
            loader.holdout = KeyHoldout(side, 30)
            sides[side] = {k for b in loader for k in b.keys}
    assert sides["eval"] and not sides["train"] & sides["eval"]
    assert len(sides["train"] | sides["eval"]) == ROWS


# -- bad blocks ----------------------------------------------------------------------------------

def block(rows: int, start: int) -> bytes:
    return encode_block(Block(
        np.array([i % 2 for i in range(rows)], np.float32),
        np.arange(rows, dtype=np.float32).reshape(rows, 1) + start,
        *pack_values([[f"c{start + i}".encode() for i in range(rows)]]), ("n",), ("c",)))


def write_shard(root: Path, samples: list[tuple[str, bytes]]) -> Path:
    writer = ShardWriter(root, "train", max_count=100, max_size=2**30)
    for key, data in samples:
        writer.write({"__key__": key, "npz": data})
    writer.finish()
    return root / "train-000000.tar"


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_bad_blocks_are_raised_or_counted(tmp_path, reader):
    shard = write_shard(tmp_path, [("a", block(5, 0)), ("b", b"PK not a zip"),
                                   ("c", block(4, 10)), ("d", block(3, 20)[:-40])])
    with tabular_loader(str(shard), batch_size=4, device="cpu", on_error="skip",
                        reader=reader) as loader:
        assert loader.schema.dense == ["n"] and loader.schema.rows is None
        keys = [k for b in loader for k in b.keys]
        assert loader.skip_counts() == {"bad-block": 2}
        assert {s["key"] for s in loader.skipped} == {"b", "d"}
    assert sorted(keys) == sorted([f"a:{i}" for i in range(5)] + [f"c:{i}" for i in range(4)])
    with tabular_loader(str(shard), batch_size=4, device="cpu", reader=reader,
                        train=False) as loader, \
            pytest.raises(DataError, match="key 'b'.*bad-block"):
        epoch(loader)


def converted_with_a_lost_block(root: Path, rows: int) -> Path:
    """`rows` Criteo rows converted in blocks of 20, then the first block's bytes damaged in
    place (same size: the index still points at it)."""
    root.mkdir()
    (root / "day.tsv").write_text("\n".join(criteo_lines(rows)) + "\n")
    convert(ConvertConfig(kind="tabular", src=str(root / "day.tsv"), out=root / "out",
                          workers=1, max_count=5,
                          tabular=TabularOptions(preset="criteo", rows_per_block=20)))
    shard = sorted((root / "out").glob("*.tar"))[0]
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".npz"))
    data[member.offset_data:member.offset_data + 4] = b"XXXX"  # not a zip any more
    shard.write_bytes(bytes(data))
    return root / "out"


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_a_lost_block_counts_its_rows_so_read_plus_skipped_is_the_manifest_rows(tmp_path,
                                                                                 reader):
    # 200 rows: every block full, so the lost one held 20 rows and the sum is exact
    out = converted_with_a_lost_block(tmp_path / "full", 200)
    with tabular_loader(out, batch_size=32, device="cpu", on_error="skip",
                        reader=reader) as loader:
        read = sum(len(b.label) for b in loader)
        assert loader.skip_counts() == {"bad-block": 1}
        assert read == 180 and read + loader.skipped_samples() == loader.schema.rows == 200
        assert loader.skipped_of_unknown_size() == 0
    # 190 rows: one block is short and the manifest does not say which, so the lost block's
    # size is unknown, and said to be (not counted as 1 row, or as 20)
    out = converted_with_a_lost_block(tmp_path / "short", 190)
    with tabular_loader(out, batch_size=32, device="cpu", on_error="skip",
                        reader=reader) as loader:
        read = sum(len(b.label) for b in loader)
        assert read == 170 and loader.skipped_samples() == 0
        assert loader.skipped_of_unknown_size() == 1 and loader.skipped[0]["samples"] is None


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_a_shard_cut_short_counts_the_rows_it_loses(tmp_path, reader):
    """The second of two shards cut inside its third block: DALI's reader drops the shard
    before the epoch (its 5 blocks), the streaming reader reads two blocks and loses the
    rest (3): either way in rows, so that rows read + skipped is the manifest's 200."""
    root = tmp_path / "cut"
    root.mkdir()
    (root / "day.tsv").write_text("\n".join(criteo_lines(200)) + "\n")
    convert(ConvertConfig(kind="tabular", src=str(root / "day.tsv"), out=root / "out",
                          workers=1, max_count=5,
                          tabular=TabularOptions(preset="criteo", rows_per_block=20)))
    shard = sorted((root / "out").glob("*.tar"))[1]
    with tarfile.open(shard) as tar:
        third = [m for m in tar.getmembers() if m.name.endswith(".npz")][2]
    shard.write_bytes(shard.read_bytes()[:third.offset_data + 100])
    with tabular_loader(root / "out", batch_size=32, device="cpu", on_error="skip",
                        reader=reader) as loader:
        read = sum(len(b.label) for b in loader)
        assert read == {"dali": 100, "stream": 140}[reader]
        assert read + loader.skipped_samples() == loader.schema.rows == 200
        assert loader.skipped_of_unknown_size() == 0 and len(loader.skipped) == 1


def test_shards_of_another_modality_are_refused(tmp_path, shards):
    (tmp_path / "t.txt").write_text("hello")
    convert(ConvertConfig(kind="text", src=str(tmp_path / "t.txt"), out=tmp_path / "text",
                          workers=1))
    with pytest.raises(ValueError, match="hold text"):
        tabular_loader(tmp_path / "text", batch_size=4, device="cpu")


@pytest.mark.gpu
def test_batches_land_on_the_gpu(shards):
    out, _ = shards
    with tabular_loader(out, batch_size=64, device="cuda") as loader:
        batch = next(iter(loader))
    assert batch.dense.is_cuda and batch.sparse.is_cuda and batch.label.is_cuda


def test_every_tensor_of_a_batch_comes_out_of_the_copier(shards, monkeypatch):
    """The CPU twin of the test above: what the copier moves lands on the device, so a batch
    field made after it would stay on the host there."""
    out, _ = shards
    outputs = copier_outputs(monkeypatch)
    with tabular_loader(out, batch_size=64, device="cpu") as loader:
        batches = list(loader)
    assert batches and all(isinstance(t, torch.Tensor) for b in batches
                           for t in (b.dense, b.sparse, b.label))
    assert [not_delivered(b, outputs) for b in batches] == [[]] * len(batches)


def test_no_warning_floods_for_one_rank(shards, caplog):
    out, _ = shards
    with caplog.at_level(logging.WARNING), tabular_loader(out, batch_size=64,
                                                          device="cpu") as loader:
        epoch(loader)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_bench_loader_tabular_figures(tmp_path):
    from conftest import run_tool

    out = tmp_path / "bench.json"
    proc = run_tool("bench_loader", "--modality", "tabular", "--rows", 3000, "--repeats", 1,
                    "--batch-size", 512, "--epochs", 1, "--threads", 1, "--work",
                    tmp_path / "work", "--json", out, check=True)
    result = json.loads(out.read_text())
    contenders = {"shardflow", "plain loop", "DataLoader per row"}
    assert set(result["rows_per_s"]) == contenders and result["rows"] == dict.fromkeys(
        contenders, 3000)  # the same rows for everyone
    assert all(v > 0 for v in result["rows_per_s"].values())
    assert all(v > 0 for v in result["hashing_values_per_s_per_core"].values())
    assert result["shardflow"]["time_to_first_batch_s"] > 0
    assert out.with_suffix(".md").read_text().strip() in proc.stdout
    assert not (tmp_path / "work").exists()


def test_resharded_shards_read_with_the_schema_of_their_first_block(shards, tmp_path):
    out, _ = shards
    convert(ConvertConfig(kind="shards", src=str(out), out=tmp_path / "re", max_count=7,
                          workers=1))
    with tabular_loader(tmp_path / "re", batch_size=64, device="cpu") as loader:
        assert loader.schema.dense == [f"I{i}" for i in range(1, 14)]
        assert loader.schema.rows is None and loader.source.modality == "tabular"
        assert sorted(line_of(k) for b in loader for k in b.keys) == list(range(ROWS))
