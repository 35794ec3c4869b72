"""The `tabular` kind's rows: read in order in the main process (`block_tasks`: lines of text
files, batches of Parquet rows), cut into blocks of `rows_per_block` rows, and parsed and
checked in a worker (`build_block`), which packs the good rows into one `.npz` member.

Blocks are cut by rows read, not by rows kept, so where a block starts depends on the input
alone: the same files give the same blocks whatever `--workers`, and a bad row only makes its
block shorter. A block's key is its first row's place (`<file>_<line:010d>`, the 1-based
line of a text file, header included, or the 0-based row of a Parquet file); with
`--shuffle-seed` rows are mixed within windows of SHUFFLE_BLOCKS blocks and the keys are
`mixed_<block:010d>`. `--part i/n` takes every n-th block (block b when b mod n == i): each
part reads all the input but parses only its own blocks.

Bad rows, each one DataError naming the file and line (or row): `wrong-field-count`,
`bad-number` (a dense value that is not a finite number), `missing-label`, `bad-label` (not 0
or 1), `bad-utf8`, `bad-quoting`, `row-too-large`; a file that stops reading part-way (a cut
gzip stream, an unreadable Parquet row group) is `truncated-file` / `bad-parquet` from there
on, keeping the rows before.
"""

from __future__ import annotations

import csv
import functools
import itertools
import math
import operator
import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

from shardflow.convert.sources import Sample
from shardflow.convert.tabular import TableFile, TabularPlan
from shardflow.errors import DataError
from shardflow.samples.tabular_block import (
    BLOCK_EXT,
    MAX_BLOB,
    Block,
    TabularSchema,
    encode_block,
    pack_values,
)

SHUFFLE_BLOCKS = 16  # --shuffle-seed mixes rows within windows of this many blocks
PARQUET_BATCH = 8192  # rows pyarrow reads at a time
MISSING = frozenset({"", "na", "nan", "null", "none"})  # dense text read as missing (any case)
RawRow = tuple[int, int, Any]  # (file index, line or row number, line bytes | tuple of values)


@dataclass(frozen=True)
class RowBlock:
    """A task: the raw rows of one block, with how to read the files they come from."""

    key: str
    rows: tuple[RawRow, ...]
    files: dict[int, TableFile]
    schema: TabularSchema

    def where(self, row: RawRow) -> str:
        info = self.files[row[0]]
        return f"{info.path} {'line' if info.fmt == 'text' else 'row'} {row[1]}"

    def describe(self) -> str:
        more = f" and {len(self.rows) - 1} more rows" if len(self.rows) > 1 else ""
        return f"{self.where(self.rows[0])}{more}" if self.rows else "no rows"


def block_tasks(plan: TabularPlan, part: tuple[int, int], shuffle_seed: int | None
                ) -> Iterator[RowBlock | DataError]:
    """This part's blocks (and the errors of whole files met on the way), in input order."""
    index, count = part
    blocks = _blocks(plan) if shuffle_seed is None else _mixed(plan, shuffle_seed)
    b = 0
    for item in blocks:
        if isinstance(item, DataError):
            if b % count == index:  # the part of the block being filled reports it
                yield item
            continue
        key, rows = item
        if b % count == index:
            files = {f: plan.files[f] for f in sorted({r[0] for r in rows})}
            yield RowBlock(key, tuple(rows), files, plan.schema)
        b += 1


def _blocks(plan: TabularPlan) -> Iterator[tuple[str, list[RawRow]] | DataError]:
    size, rows = plan.opts.rows_per_block, []
    for item in _records(plan):
        if isinstance(item, DataError):
            yield item
            continue
        rows.append(item)
        if len(rows) == size:
            yield _key(plan, rows), rows
            rows = []
    if rows:
        yield _key(plan, rows), rows


def _key(plan: TabularPlan, rows: list[RawRow]) -> str:
    return f"{plan.files[rows[0][0]].prefix}_{rows[0][1]:010d}"


def _mixed(plan: TabularPlan, seed: int) -> Iterator[tuple[str, list[RawRow]] | DataError]:
    """Blocks whose rows are shuffled within windows of SHUFFLE_BLOCKS blocks."""
    size, window, b = plan.opts.rows_per_block, [], 0
    blocks = _blocks(plan)
    for w in itertools.count():
        for item in blocks:
            if isinstance(item, DataError):
                yield item
                continue
            window.extend(item[1])
            if len(window) >= size * SHUFFLE_BLOCKS:
                break
        if not window:
            return
        random.Random(f"{seed}/{w}").shuffle(window)
        for lo in range(0, len(window), size):
            yield f"mixed_{b:010d}", window[lo: lo + size]
            b += 1
        window = []


def _records(plan: TabularPlan) -> Iterator[RawRow | DataError]:
    for f, info in enumerate(plan.files):
        if info.error:
            reason = "bad-parquet" if info.fmt == "parquet" else "bad-file"
            yield DataError(reason, info.error, source=info.path, samples=None)
        elif info.fmt == "parquet":
            yield from _parquet_records(f, info, plan.schema)
        else:
            yield from _text_records(f, info, plan.opts.max_row_bytes)


def _text_records(f: int, info: TableFile, limit: int) -> Iterator[RawRow | DataError]:
    """(f, line number, record bytes) of each non-blank record; a quoted field may run over
    several lines (comma-separated files), the record then named by its first line."""
    line_no, first, quotes = 0, 0, 0
    pending: list[bytes] = []
    try:
        with info.opener()(info.path, "rb") as src:
            while line := src.readline(limit + 1):
                line_no += 1
                if len(line) > limit and not line.endswith(b"\n"):
                    while (rest := src.readline(1 << 20)) and not rest.endswith(b"\n"):
                        pass
                    pending = []
                    yield _too_large(info, line_no, limit)
                    continue
                if line_no == 1:
                    line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
                    if info.header:
                        continue
                body = line.rstrip(b"\r\n")
                if info.quoting and (pending or body.count(b'"') % 2):
                    first = first if pending else line_no
                    pending.append(body)
                    quotes += body.count(b'"')
                    if quotes % 2:
                        if sum(map(len, pending)) > limit:
                            pending, quotes = [], 0
                            yield _too_large(info, first, limit)
                        continue
                    body, pending, quotes = b"\n".join(pending), [], 0
                    yield f, first, body
                elif body.strip():
                    yield f, line_no, body
            if pending:  # a quote never closed: the worker names it
                yield f, first, b"\n".join(pending)
    except (OSError, EOFError, zlib.error) as exc:
        yield DataError("truncated-file", f"the file stops reading after line {line_no}: "
                        f"{exc}; the rows before are kept", source=info.path, samples=None)


def _too_large(info: TableFile, line_no: int, limit: int) -> DataError:
    return DataError("row-too-large", f"the row is longer than max_row_bytes={limit}",
                     source=f"{info.path} line {line_no}", samples=1)


def _parquet_records(f: int, info: TableFile, schema: TabularSchema
                     ) -> Iterator[RawRow | DataError]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = [schema.label, *schema.dense, *schema.categorical]
    row = 0
    try:
        with pq.ParquetFile(info.path, buffer_size=1 << 20, pre_buffer=False) as pf:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH, columns=names,
                                         use_threads=False):
                columns = [batch.column(name).to_pylist() for name in names]
                for values in zip(*columns, strict=True):
                    yield f, row, values
                    row += 1
    except (pa.ArrowException, OSError) as exc:
        yield DataError("bad-parquet", f"rows from {row} on do not read: {exc}",
                        source=info.path, samples=None)


# -- the worker side: one block -> one sample ------------------------------------------------

class _Columns:
    """The good rows of a block, column by column."""

    def __init__(self, schema: TabularSchema) -> None:
        self.schema = schema
        self.label: list[float] = []
        self.dense: list[float] = []
        self.cat: list[list[bytes]] = [[] for _ in schema.categorical]

    def add(self, values: tuple[Any, ...] | list[Any]) -> None:
        """One row's (label, dense..., categorical...) values; DataError leaves no trace."""
        d = len(self.schema.dense)
        label = _label(values[0])
        dense = [_dense(v, name) for v, name in zip(values[1: 1 + d], self.schema.dense,
                                                     strict=True)]
        cat = [_category(v) for v in values[1 + d:]]
        self.label.append(label)
        self.dense.extend(dense)
        for column, value in zip(self.cat, cat, strict=True):
            column.append(value)

    def block(self) -> Block:
        n = len(self.label)
        offsets, blob = pack_values(self.cat)
        return Block(np.array(self.label, np.float32),
                     np.array(self.dense, np.float32).reshape(n, len(self.schema.dense)),
                     offsets, blob, self.schema.dense, self.schema.categorical)


def build_block(task: RowBlock) -> list[Sample | DataError]:
    """Parse and check a block's rows: a DataError per bad row (naming file and line), then
    the block of the good ones as one sample (none when every row was bad)."""
    errors: list[tuple[int, DataError]] = []
    parsed: list[tuple[int, Any]] = []
    for i, row in enumerate(task.rows):
        try:
            info = task.files[row[0]]
            parsed.append((i, _fields(info, row[2]) if info.fmt == "text" else row[2]))
        except DataError as err:
            errors.append((i, err.located(source=task.where(row))))
    block = _fast_block([v for _, v in parsed], task.schema)
    if block is None:  # some value the fast path does not take: row by row, naming rows
        columns = _Columns(task.schema)
        for i, values in parsed:
            try:
                columns.add(values)
            except DataError as err:
                errors.append((i, err.located(source=task.where(task.rows[i]))))
        block = columns.block() if columns.label else None
    out: list[Sample | DataError] = [err for _, err in sorted(errors, key=lambda e: e[0])]
    if block is not None:
        try:
            data = encode_block(block)
        except DataError as err:
            return [*out, err.located(source=task.describe(), key=task.key)]
        out.append({"__key__": task.key, BLOCK_EXT: data, "__rows__": block.rows})
    return out


_LABELS: dict[Any, float] = {"0": 0.0, "1": 1.0, 0: 0.0, 1: 1.0}  # 0 == 0.0 == False
_MISSING_AS_IS = frozenset({"", "NA", "NaN", "nan", "na", "null", "NULL", "None", "none"})
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _fast_block(rows: list[Any], schema: TabularSchema) -> Block | None:
    """The block of rows whose values are all plain (labels 0/1, dense numbers or the usual
    missing marks), in a few tight loops; None when any is not (the caller goes row by row,
    which gives the same values and names the bad rows)."""
    if not rows:
        return None
    d = len(schema.dense)
    columns = list(zip(*rows, strict=True))  # column by column, transposed in C
    try:
        label = [_LABELS[v] for v in columns[0]]
        dense = [[math.nan if x is None or x in _MISSING_AS_IS else float(x) for x in column]
                 for column in columns[1: 1 + d]]
    except (KeyError, ValueError, TypeError):
        return None
    values = np.array(dense, np.float64).reshape(d, len(rows)).T
    if np.abs(values[~np.isnan(values)]).max(initial=0.0) > _FLOAT32_MAX:
        return None  # an infinity, or beyond float32: the row-by-row path names it
    parts: list[Any] = []
    for column in columns[1 + d:]:
        try:
            joined = "".join(column)
        except TypeError:  # nulls or integers (Parquet)
            parts.append([_category(v) for v in column])
            continue
        if joined.isascii():  # a character is a byte: one encode for the whole column
            parts.append((joined.encode("ascii"), list(map(len, column))))
        else:
            parts.append([_category(v) for v in column])
    offsets, blob = _pack(parts)
    return Block(np.array(label, np.float32), values.astype(np.float32), offsets, blob,
                 schema.dense, schema.categorical)


def _pack(parts: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """pack_values for columns given either as values or as (joined bytes, lengths)."""
    if all(isinstance(p, list) for p in parts):
        return pack_values(parts)
    lengths = [n for p in parts for n in (p[1] if isinstance(p, tuple) else map(len, p))]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > MAX_BLOB:
        raise DataError("block-too-large", f"the block's categorical values take "
                        f"{offsets[-1]} bytes (at most {MAX_BLOB}); use fewer rows per block")
    blob = b"".join(p[0] if isinstance(p, tuple) else b"".join(p) for p in parts)
    return offsets.astype(np.int32), np.frombuffer(blob, dtype=np.uint8)


def _fields(info: TableFile, raw: bytes) -> tuple[str, ...]:
    """The record's fields of (label, dense..., categorical...)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad("bad-utf8", f"not UTF-8 at byte {exc.start}") from None
    if info.quoting:
        try:
            fields = next(csv.reader([text], delimiter=info.delimiter, strict=True))
        except csv.Error as exc:
            raise _bad("bad-quoting", f"the row's quotes do not parse: {exc}") from None
    else:
        fields = text.split(info.delimiter)
    if len(fields) != info.width:
        raise _bad("wrong-field-count", f"{len(fields)} fields, expected {info.width}")
    return _picker(info.take)(fields)


@functools.cache
def _picker(take: tuple[int, ...]) -> Callable[[list[str]], Any]:
    """The fields of (label, dense..., categorical...) out of a record's, picked in C."""
    return operator.itemgetter(*take) if len(take) > 1 else lambda fields: (fields[take[0]],)


def _bad(reason: str, detail: str) -> DataError:
    return DataError(reason, detail, samples=1)  # one row


def _label(value: Any) -> float:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise _bad("missing-label", "the label is empty")
    number = _number(value)
    if number is None or math.isnan(number):
        raise _bad("missing-label" if number is not None else "bad-label",
                   f"the label {value!r:.40} is not a number")
    if number not in (0.0, 1.0):
        raise _bad("bad-label", f"the label {value!r:.40} is not 0 or 1")
    return number


def _dense(value: Any, name: str) -> float:
    if value is None or (isinstance(value, str) and value.strip().lower() in MISSING):
        return math.nan
    number = _number(value)
    if number is None or not abs(number) <= _FLOAT32_MAX:  # blocks hold float32
        raise _bad("bad-number", f"column {name!r}: {value!r:.40} is not a finite number "
                   "within float32's range")
    return number


def _number(value: Any) -> float | None:
    if isinstance(value, (bool, int, float, Decimal)):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        return None


def _category(value: Any) -> bytes:
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    return str(value).encode("utf-8", "surrogateescape")
