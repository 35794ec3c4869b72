"""make_shards' tabular kind: Criteo-style headerless TSV and Avazu-style CSV with a header,
the oddities of real files (CRLF, a byte order mark, quoted commas and newlines, gzip, a cut
last line), Parquet with nulls; bad rows raised or counted with their lines; determinism,
resume, parts and row shuffling; the block format's own checks."""

from __future__ import annotations

import gzip
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import convert_killed, load_manifest, read_wds, run_tool, shard_paths

from shardflow.convert import ConvertConfig, convert, tabular_rows
from shardflow.convert.tabular import AVAZU_CATEGORICAL, TabularOptions
from shardflow.errors import DataError
from shardflow.samples.tabular_block import decode_block, encode_block

AVAZU_HEADER = ["id", "click", *AVAZU_CATEGORICAL]


def criteo_lines(n: int, seed: int = 0) -> list[str]:
    """Headerless Criteo-style rows: label, 13 integer counts, 26 hex ids; some empty."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        dense = [str(int(v)) if rng.random() > 0.2 else "" for v in rng.integers(-2, 900, 13)]
        cat = [f"{int(v):08x}" if rng.random() > 0.1 else "" for v in rng.integers(0, 2**32, 26)]
        lines.append("\t".join([str(int(rng.integers(0, 2))), *dense, *cat]))
    return lines


def blocks_of(out: Path) -> list[tuple[str, object]]:
    return [(s["__key__"], decode_block(s["npz"])) for s in read_wds(out)]


def rows_of(out: Path) -> list[tuple]:
    """Every row as (label, dense with None for missing, categorical strings), shard order."""
    rows = []
    for _, b in blocks_of(out):
        f, n = len(b.cat_names), b.rows
        values = [b.cat_blob[b.cat_offsets[i]: b.cat_offsets[i + 1]].tobytes().decode()
                  for i in range(f * n)]
        for r in range(n):
            dense = tuple(None if np.isnan(v) else float(v) for v in b.dense[r])
            rows.append((float(b.label[r]), dense, tuple(values[k * n + r] for k in range(f))))
    return rows


def expected_criteo(line: str) -> tuple:
    fields = line.split("\t")
    return (float(fields[0]), tuple(float(v) if v else None for v in fields[1:14]),
            tuple(fields[14:]))


def cfg(src: Path, out: Path, **kw: object) -> ConvertConfig:
    opts = kw.pop("tabular", TabularOptions(preset="criteo", rows_per_block=64))
    return ConvertConfig(kind="tabular", src=str(src), out=out, workers=1, tabular=opts, **kw)


# -- round trips -------------------------------------------------------------------------------

def test_criteo_tsv_headerless_with_empty_fields_round_trips(tmp_path):
    lines = criteo_lines(300)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "day_0.tsv").write_text("\n".join(lines[:200]) + "\n")
    with gzip.open(tmp_path / "src" / "day_1.gz", "wt") as f:  # Criteo's own naming
        f.write("\n".join(lines[200:]))  # no newline after the last line
    proc = run_tool("make_shards", "tabular", tmp_path / "src", tmp_path / "out", "--quiet",
                    "--preset", "criteo", "--rows-per-block", 64, "--max-count", 2, check=True)
    assert "rows: 300 in 5 blocks" in proc.stdout
    m = load_manifest(tmp_path / "out")
    assert m["modality"] == "tabular" and m["total_samples"] == 5 and len(m["shards"]) == 3
    assert m["tabular"]["rows"] == 300 and m["tabular"]["rows_per_block"] == 64
    assert m["tabular"]["schema"]["dense"] == [f"I{i}" for i in range(1, 14)]
    assert len(m["tabular"]["schema"]["categorical"]) == 26
    assert rows_of(tmp_path / "out") == [expected_criteo(line) for line in lines]
    # A block may span files; its key is where its first row is.
    assert [k for k, _ in blocks_of(tmp_path / "out")] == [
        "day_0_0000000001", "day_0_0000000065", "day_0_0000000129", "day_0_0000000193",
        "day_1_0000000057"]


def avazu_csv(rows: list[list[str]], *, bom: bool = False, crlf: bool = False) -> bytes:
    out = io.StringIO()
    import csv

    csv.writer(out, lineterminator="\r\n" if crlf else "\n").writerows([AVAZU_HEADER, *rows])
    return (b"\xef\xbb\xbf" if bom else b"") + out.getvalue().encode()


def avazu_row(i: int, **change: str) -> list[str]:
    row = {name: f"{name[:3]}{i % 7}" for name in AVAZU_HEADER}
    row.update(id=str(10**19 + i), click=str(i % 2), hour="14102100", **change)
    return [row[name] for name in AVAZU_HEADER]


def test_avazu_csv_with_header_bom_crlf_quotes_and_gzip(tmp_path):
    rows = [avazu_row(i) for i in range(40)]
    rows[3] = avazu_row(3, site_domain="a,b")  # a quoted comma
    rows[4] = avazu_row(4, site_category='say "hi"\nthere')  # quotes and a newline inside
    rows[5] = avazu_row(5, app_id="")  # missing
    rows[6] = avazu_row(6, site_id="café")  # not ASCII
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.csv").write_bytes(avazu_csv(rows[:20], bom=True, crlf=True))
    (tmp_path / "src" / "b.csv.gz").write_bytes(gzip.compress(avazu_csv(rows[20:])))
    (tmp_path / "src" / "README.md").write_text("not a table")
    m = convert(cfg(tmp_path / "src", tmp_path / "out",
                    tabular=TabularOptions(preset="avazu", rows_per_block=16)))
    assert m.tabular["rows"] == 40 and m.ignored[0]["reason"] == "not-a-table-file"
    got = rows_of(tmp_path / "out")
    keep = [AVAZU_HEADER.index(c) for c in AVAZU_CATEGORICAL]
    assert got == [(float(r[1]), (), tuple(r[k] for k in keep)) for r in rows]
    assert got[4][2][AVAZU_CATEGORICAL.index("site_category")] == 'say "hi"\nthere'
    # The row after a two-line record is named by its own line: line 7 of a.csv is row 6.
    keys = [k for k, _ in blocks_of(tmp_path / "out")]
    assert keys == ["a_0000000002", "a_0000000019", "b_0000000014"]


def test_parquet_with_nulls_matches_the_same_table_as_csv(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({
        "y": pa.array([1, 0, 1, 0, 1], pa.int64()),
        "price": pa.array([1.5, None, float("nan"), 3.0, -2.0], pa.float64()),
        "count": pa.array([7, 8, None, 10, 11], pa.int32()),
        "site": pa.array(["x", None, "z", "", "x"], pa.string()).dictionary_encode(),
        "c1": pa.array([1005, 1002, None, 1005, 7], pa.int64()),
    })
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    (tmp_path / "t.csv").write_text("y,price,count,site,c1\n1,1.5,7,x,1005\n0,,8,,1002\n"
                                    "1,NaN,,z,\n0,3.0,10,,1005\n1,-2,11,x,7\n")
    opts = TabularOptions(label_column="y", dense_columns=("price", "count"),
                          categorical_columns=("site", "c1"), rows_per_block=3)
    for name in ("t.parquet", "t.csv"):
        convert(cfg(tmp_path / name, tmp_path / f"out-{name}", tabular=opts))
    from_parquet = rows_of(tmp_path / "out-t.parquet")
    assert from_parquet == rows_of(tmp_path / "out-t.csv")
    assert from_parquet[2] == (1.0, (None, None), ("z", ""))
    assert from_parquet[0] == (1.0, (1.5, 7.0), ("x", "1005"))


def test_a_float_parquet_column_is_not_categorical(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"y": [1], "f": [0.5]}), tmp_path / "t.parquet")
    opts = TabularOptions(label_column="y", categorical_columns=("f",))
    with pytest.raises(ValueError, match="float.*--dense-columns"):
        convert(cfg(tmp_path / "t.parquet", tmp_path / "out", tabular=opts))


# -- bad rows ------------------------------------------------------------------------------------

BAD = ["1\t2\t3",                                 # line 2: wrong field count
       "0\tabc" + "\t" * 38,                      # line 3: unparsable number
       "\t1" + "\t" * 38,                         # line 4: missing label
       "2" + "\t" * 39,                           # line 5: label not 0/1
       "1\tinf" + "\t" * 38]                      # line 6: not finite


def bad_file(tmp_path: Path) -> Path:
    good = criteo_lines(8)
    lines = [good[0], *BAD, *good[1:], good[0][:30]]  # the last line cut off
    (tmp_path / "bad.tsv").write_text("\n".join(lines))
    return tmp_path / "bad.tsv"


def test_bad_rows_raise_naming_file_and_line(tmp_path):
    src = bad_file(tmp_path)
    proc = run_tool("make_shards", "tabular", src, tmp_path / "out", "--quiet", "--preset",
                    "criteo")
    assert proc.returncode != 0
    assert f"{src} line 2" in proc.stderr and "wrong-field-count" in proc.stderr
    assert "--on-error skip" in proc.stderr


def test_bad_rows_skipped_are_counted_per_reason_with_their_lines(tmp_path):
    src = bad_file(tmp_path)
    m = convert(cfg(src, tmp_path / "out", on_error="skip")).to_json()
    assert m["skipped_counts"] == {"bad-label": 1, "bad-number": 2, "missing-label": 1,
                                   "wrong-field-count": 2}
    where = {e["source"]: e["reason"] for e in m["skipped"]}
    assert where == {f"{src} line 2": "wrong-field-count", f"{src} line 3": "bad-number",
                     f"{src} line 4": "missing-label", f"{src} line 5": "bad-label",
                     f"{src} line 6": "bad-number", f"{src} line 14": "wrong-field-count"}
    assert m["tabular"]["rows"] == 8 and all(e["samples"] == 1 for e in m["skipped"])


def test_a_cut_gzip_stream_keeps_the_rows_before(tmp_path):
    data = gzip.compress(("\n".join(criteo_lines(400)) + "\n").encode())
    (tmp_path / "cut.tsv.gz").write_bytes(data[: len(data) // 2])
    m = convert(cfg(tmp_path / "cut.tsv.gz", tmp_path / "out", on_error="skip")).to_json()
    assert 0 < m["tabular"]["rows"] < 400
    assert "truncated-file" in m["skipped_counts"]


def test_too_long_rows_are_bad_rows_read_in_bounded_memory(tmp_path):
    lines = criteo_lines(3)
    lines[1] = lines[1] + "x" * 5000
    (tmp_path / "t.tsv").write_text("\n".join(lines))
    opts = TabularOptions(preset="criteo", max_row_bytes=1000)
    m = convert(cfg(tmp_path / "t.tsv", tmp_path / "out", on_error="skip", tabular=opts))
    assert m.to_json()["skipped_counts"] == {"row-too-large": 1} and m.tabular["rows"] == 2


@pytest.mark.parametrize(("opts", "expected"), [
    (TabularOptions(dense_columns=("a",)), "--label-column"),
    (TabularOptions(label_column="y"), "--dense-columns"),
    (TabularOptions(label_column="y", dense_columns=("y",)), "more than once"),
    (TabularOptions(label_column="y", dense_columns=("nope",)), "no column 'nope'"),
    (TabularOptions(label_column="y", dense_columns=("a",), rows_per_block=0), "rows_per_block"),
])
def test_wrong_options_are_clear_usage_errors(tmp_path, opts, expected):
    (tmp_path / "t.csv").write_text("y,a\n1,2\n")
    with pytest.raises(ValueError, match=expected):
        convert(cfg(tmp_path / "t.csv", tmp_path / "out", tabular=opts))


def test_a_schema_file_names_the_columns(tmp_path):
    (tmp_path / "t.txt").write_text("1;5;red\n0;;blue\n")
    (tmp_path / "schema.json").write_text(json.dumps(
        {"label": "y", "dense": ["a"], "categorical": ["c"], "names": ["y", "a", "c"],
         "delimiter": ";"}))
    run_tool("make_shards", "tabular", tmp_path / "t.txt", tmp_path / "out", "--quiet",
             "--schema", tmp_path / "schema.json", check=True)
    assert rows_of(tmp_path / "out") == [(1.0, (5.0,), ("red",)), (0.0, (None,), ("blue",))]


# -- the guarantees: determinism, resume, parts, shuffling -----------------------------------------

def write_criteo(tmp_path: Path, n: int = 500) -> Path:
    (tmp_path / "src").mkdir()
    lines = criteo_lines(n)
    lines[17] = "1\tx" + "\t" * 38  # one bad row, skipped
    (tmp_path / "src" / "a.tsv").write_text("\n".join(lines[:230]) + "\n")
    (tmp_path / "src" / "b.tsv").write_text("\n".join(lines[230:]) + "\n")
    return tmp_path / "src"


def shard_bytes(out: Path) -> list[tuple[bytes, bytes]]:
    return [(p.read_bytes(), p.with_suffix(".idx").read_bytes()) for p in shard_paths(out)]


def test_same_shards_whatever_the_workers_and_shuffled_rows_are_the_same_rows(tmp_path):
    src = write_criteo(tmp_path)
    common = ["--quiet", "--preset", "criteo", "--rows-per-block", 50, "--max-count", 3,
              "--on-error", "skip"]
    for name, workers, seed in (("a", 1, None), ("b", 2, None), ("s", 2, 4)):
        extra = ["--shuffle-seed", seed] if seed is not None else []
        run_tool("make_shards", "tabular", src, tmp_path / name, "--workers", workers,
                 *common, *extra, check=True)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    plain, mixed = rows_of(tmp_path / "a"), rows_of(tmp_path / "s")
    assert len(plain) == 499 and mixed != plain
    assert sorted(mixed, key=repr) == sorted(plain, key=repr)
    again = convert(cfg(src, tmp_path / "s2", shuffle_seed=4, on_error="skip", max_count=3,
                        tabular=TabularOptions(preset="criteo", rows_per_block=50)))
    assert again.tabular["rows"] == 499
    assert shard_bytes(tmp_path / "s") == shard_bytes(tmp_path / "s2")


@pytest.mark.parametrize("seed", [None, 2])
def test_an_interrupted_conversion_resumes_to_the_same_shards(tmp_path, monkeypatch, seed):
    """Killed (SIGKILL, in a child process) after 7 blocks, then the same conversion again."""
    monkeypatch.setattr(tabular_rows, "SHUFFLE_BLOCKS", 3)
    src = write_criteo(tmp_path, 300)

    def config(out: Path) -> ConvertConfig:
        return cfg(src, out, max_count=2, on_error="skip", shuffle_seed=seed,
                   tabular=TabularOptions(preset="criteo", rows_per_block=20))

    whole = convert(config(tmp_path / "whole"))
    convert_killed(config(tmp_path / "out"), 7, tmp_path,
                   {f"{tabular_rows.__name__}.SHUFFLE_BLOCKS": 3})
    assert (tmp_path / "out" / ".make_shards.journal.json").exists()
    assert not (tmp_path / "out" / "manifest.json").exists()
    resumed = convert(config(tmp_path / "out"))
    assert resumed.tabular == whole.tabular and resumed.tabular["rows"] == 299
    assert resumed.to_json()["skipped"] == whole.to_json()["skipped"]
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "whole")


def test_parts_then_merge_hold_every_row_once(tmp_path):
    src = write_criteo(tmp_path, 300)
    out = tmp_path / "parts"
    for i in range(3):
        convert(cfg(src, out, part=(i, 3), on_error="skip",
                    tabular=TabularOptions(preset="criteo", rows_per_block=40)))
    run_tool("make_shards", "merge", out, check=True)
    m = load_manifest(out)
    assert m["tabular"]["rows"] == 299 and m["tabular"]["blocks"] == m["total_samples"] == 8
    assert len(m["skipped"]) == 1  # reported by one part only
    convert(cfg(src, tmp_path / "whole", on_error="skip",
                tabular=TabularOptions(preset="criteo", rows_per_block=40)))
    assert sorted(rows_of(out), key=repr) == sorted(rows_of(tmp_path / "whole"), key=repr)


# -- the block format ------------------------------------------------------------------------------

def one_block(tmp_path: Path) -> bytes:
    (tmp_path / "t.tsv").write_text("\n".join(criteo_lines(5)))
    convert(cfg(tmp_path / "t.tsv", tmp_path / "out"))
    return read_wds(tmp_path / "out")[0]["npz"]


def rezip(data: bytes, change: dict[str, object], compress: bool = False) -> bytes:
    """The block with members replaced (arrays written by numpy, pickles allowed here)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(
            out, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as dst:
        for name in src.namelist():
            body = src.read(name)
            if name[:-4] in change:
                buf = io.BytesIO()
                np.save(buf, change[name[:-4]], allow_pickle=True)
                body = buf.getvalue()
            dst.writestr(name, body)
    return out.getvalue()


def test_blocks_are_deterministic_and_refuse_what_they_are_not(tmp_path):
    data = one_block(tmp_path)
    block = decode_block(data)
    assert encode_block(block) == data and block.rows == 5
    bad = {"pickle": rezip(data, {"cat_names": np.array([object()] * 26, dtype=object)}),
           "compressed": rezip(data, {}, compress=True),
           "label": rezip(data, {"label": np.array([0, 1, 2, 1, 0], np.float32)}),
           "dtype": rezip(data, {"dense": block.dense.astype(np.float64)}),
           "offsets": rezip(data, {"cat_offsets": block.cat_offsets[::-1].copy()}),
           "garbage": b"PK\x03\x04 not really"}
    for payload in bad.values():
        with pytest.raises(DataError, match="bad-block"):
            decode_block(payload)


def test_columns_named_by_flags_on_a_headerless_file(tmp_path):
    (tmp_path / "t.txt").write_text("1|5|red|x\r\n0||blue|y\r\n")
    run_tool("make_shards", "tabular", tmp_path / "t.txt", tmp_path / "out", "--quiet",
             "--names", "y,a,c,unused", "--label-column", "y", "--dense-columns", "a",
             "--categorical-columns", "c", "--delimiter", "|", check=True)
    assert rows_of(tmp_path / "out") == [(1.0, (5.0,), ("red",)), (0.0, (None,), ("blue",))]
    assert load_manifest(tmp_path / "out")["args"]["tabular"]["names"] == ["y", "a", "c",
                                                                          "unused"]
