"""The `parquet` kind's rows: the job's tasks streamed from a plan (`row_tasks`: chunks of
consecutive rows, cut where the files' metadata says, read a row group at a time) and checked
in a worker (`build_rows`). Planning (files, columns, labels, keys) is in parquet.py.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from shardflow.convert.parquet import (
    READ_BUFFER,
    SHUFFLE_BYTES,
    SHUFFLE_ROWS,
    ParquetFileInfo,
    ParquetOptions,
    ParquetPlan,
    Problem,
    _pyarrow,
    safe_key,
    to_list,
)
from shardflow.convert.sources import Sample
from shardflow.errors import DataError
from shardflow.samples import checks


@dataclass(frozen=True)
class RawRow:
    """One row as read, for a worker to check: `problem` (reason, detail) when the row is bad
    already (a null image, a missing label, a repeated key)."""

    source: str  # "<file> row <n>"
    key: str
    image: bytes | None = None
    text: bytes | None = None
    label: int | None = None
    problem: Problem | None = None


@dataclass(frozen=True)
class RowChunk:
    """A task: consecutive rows (or, with --shuffle-seed, rows of one window)."""

    rows: tuple[RawRow, ...]

    def describe(self) -> str:
        more = f" and {len(self.rows) - 1} more rows" if len(self.rows) > 1 else ""
        return f"{self.rows[0].source}{more}" if self.rows else "no rows"


@dataclass(frozen=True)
class _Chunk:
    """Where a chunk lies: file index, row group (-1: the file did not open), its first row
    within the group and within the file, and its row count."""

    file: int
    group: int
    start: int
    first: int
    rows: int



def row_tasks(plan: ParquetPlan, part: tuple[int, int], shuffle_seed: int | None,
              start: int = 0) -> Iterator[RowChunk | DataError]:
    """This part's chunks from chunk `start` on: in file order, or with a seed shuffled within
    windows of rows whose bounds depend on the metadata only (a resumed run mixes alike)."""
    chunks = _chunks(plan, part)
    if shuffle_seed is None:
        for _, task in _read(plan, itertools.islice(chunks, start, None)):
            yield task
        return
    done = 0
    for w, window in enumerate(_windows(plan, chunks)):
        if done + len(window) > start:
            mixed = _mix(list(_read(plan, window)), random.Random(f"{shuffle_seed}/{w}"))
            yield from mixed[max(start - done, 0):]
        done += len(window)


def _chunks(plan: ParquetPlan, part: tuple[int, int]) -> Iterator[_Chunk]:
    """The chunks of rows [lo, hi) of all files in order: cut at row group starts and at
    multiples of the file's chunk size within a group. A file whose footer did not read is
    one chunk of no rows, in the part holding its position."""
    lo, hi = plan.part_range(part)
    last = part[0] == part[1] - 1
    offset = 0
    for f, info in enumerate(plan.files):
        if info.error:
            if lo <= offset < hi or (last and offset == hi):
                yield _Chunk(f, -1, 0, 0, 0)
            continue
        first = 0
        for g, rows in enumerate(info.groups):
            pos, end = max(lo - offset - first, 0), min(hi - offset - first, rows)
            while pos < end:
                stop = min((pos // info.chunk_rows + 1) * info.chunk_rows, end)
                yield _Chunk(f, g, pos, first + pos, stop - pos)
                pos = stop
            first += rows
        offset += info.rows


def _windows(plan: ParquetPlan, chunks: Iterable[_Chunk]) -> Iterator[list[_Chunk]]:
    window: list[_Chunk] = []
    rows, size = 0, 0.0
    for chunk in chunks:
        window.append(chunk)
        rows += chunk.rows
        size += chunk.rows * plan.files[chunk.file].row_bytes
        if rows >= SHUFFLE_ROWS or size >= SHUFFLE_BYTES:
            yield window
            window, rows, size = [], 0, 0.0
    if window:
        yield window


def _mix(window: list[tuple[_Chunk, RowChunk | DataError]], rng: random.Random
         ) -> list[RowChunk | DataError]:
    """The window's rows shuffled across its chunks (each keeps its size); errors stay."""
    rows = [r for _, task in window if isinstance(task, RowChunk) for r in task.rows]
    rng.shuffle(rows)
    out: list[RowChunk | DataError] = []
    for _, task in window:
        if isinstance(task, RowChunk):
            out.append(RowChunk(tuple(rows[:len(task.rows)])))
            rows = rows[len(task.rows):]
        else:
            out.append(task)
    return out


def _read(plan: ParquetPlan, chunks: Iterable[_Chunk]
          ) -> Iterator[tuple[_Chunk, RowChunk | DataError]]:
    """Each chunk with its rows, reading one row group at a time; a row group that fails to
    read (or holds fewer rows than its footer says) is one error per chunk from there."""
    import pyarrow as pa

    for (f, g), group in itertools.groupby(chunks, key=lambda c: (c.file, c.group)):
        info, specs = plan.files[f], list(group)
        if g < 0:
            yield specs[0], DataError("bad-parquet", f"pyarrow cannot read the file: "
                                      f"{info.error}", source=info.path, samples=None)
            continue
        done, problem = 0, "the row group holds fewer rows than the file's footer says"
        try:
            for spec, table in zip(specs, _slices(info, g, specs, plan.opts), strict=False):
                yield spec, _row_chunk(plan, f, spec, table)
                done += 1
        except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
            problem = f"row group {g} does not read: {exc}"
        for spec in specs[done:]:
            yield spec, DataError("bad-parquet", problem, samples=spec.rows, source=(
                f"{info.path} rows {spec.first}..{spec.first + spec.rows - 1}"))


def _slices(info: ParquetFileInfo, group: int, specs: list[_Chunk], opts: ParquetOptions
            ) -> Iterator[Any]:
    """A table of each chunk's rows, read in batches from one row group."""
    import pyarrow as pa

    pq = _pyarrow()
    with pq.ParquetFile(info.path, buffer_size=READ_BUFFER, pre_buffer=False) as pf:
        batches = pf.iter_batches(batch_size=info.chunk_rows, row_groups=[group],
                                  columns=opts.columns(), use_threads=False)
        held, base = None, 0  # rows held from group row `base` on
        for spec in specs:
            end = spec.start + spec.rows
            while held is None or base + held.num_rows < end:
                batch = next(batches, None)
                if batch is None:
                    return
                table = pa.Table.from_batches([batch])
                held = table if held is None else pa.concat_tables([held, table])
                if spec.start > base:  # rows before the chunk (where a rerun resumes): dropped
                    cut = min(spec.start - base, held.num_rows)
                    held, base = held.slice(cut), base + cut
            yield held.slice(spec.start - base, spec.rows)
            held, base = held.slice(end - base), end


def _row_chunk(plan: ParquetPlan, f: int, spec: _Chunk, table: Any) -> RowChunk:
    values = {role: to_list(table.column(col), role) for role, col in plan.opts.roles()}
    return RowChunk(tuple(_raw_row(plan, f, spec.first + i, {r: v[i] for r, v in
                                                             values.items()})
                          for i in range(spec.rows)))


def _raw_row(plan: ParquetPlan, f: int, row: int, values: dict[str, Any]) -> RawRow:
    """One row, with the first problem found before any content check."""
    info, opts = plan.files[f], plan.opts
    key, problem = _row_key(plan, f, row, values.get("key"))
    if problem is None and opts.image_column and values["image"] is None:
        problem = ("missing-image", f"column {opts.image_column!r} holds no image bytes "
                   "(null, or a path only: paths in the data are not followed)")
    if problem is None and opts.text_column and values["text"] is None:
        problem = ("missing-text", f"column {opts.text_column!r} is null")
    label = None
    if problem is None and opts.label_column:
        label, problem = _row_label(plan, values["label"])
    return RawRow(f"{info.path} row {row}", key, values.get("image"), values.get("text"),
                  label, problem)


def _row_key(plan: ParquetPlan, f: int, row: int, value: object
             ) -> tuple[str, Problem | None]:
    """`<file prefix>_<row:08d>`, or the key column's value made safe."""
    fallback = f"{plan.files[f].prefix}_{row:08d}"
    column = plan.opts.key_column
    if not column:
        return fallback, None
    if value is None:
        return fallback, ("missing-key", f"key column {column!r} is null")
    key = safe_key(value)
    if not key:
        return fallback, ("bad-key", f"key {value!r} has no letters or digits")
    keeper = plan.duplicates.get(key, (f, row))
    if keeper != (f, row):
        return key, ("duplicate-key", f"key {key!r} is already the key of "
                     f"{plan.files[keeper[0]].path} row {keeper[1]}")
    return key, None


def _row_label(plan: ParquetPlan, value: object) -> tuple[int | None, Problem | None]:
    column = plan.opts.label_column
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, ("missing-label", f"label column {column!r} is null or empty")
    if isinstance(value, str):
        if plan.classes is None or value not in plan.classes:
            return None, ("unknown-label", f"label {value!r} is not in the class map")
        return plan.classes[value], None
    label = int(value)  # type: ignore[call-overload]
    bound = plan.num_classes if plan.num_classes is not None else 2**63
    if not 0 <= label < bound:
        hint = " (Hugging Face marks unlabelled rows -1: leave out --label-column for such a " \
               "split)" if label == -1 else ""
        return None, ("label-out-of-range", f"label {label} is not in [0, {bound}){hint}")
    return label, None


# -- the worker side: one chunk -> samples ------------------------------------------------------

def build_rows(task: RowChunk, limits: checks.CheckLimits) -> list[Sample | DataError]:
    """Check each row of a chunk: one sample or one DataError (naming file and row) each."""
    out: list[Sample | DataError] = []
    for row in task.rows:
        try:
            out.append(_row_sample(row, limits))
        except DataError as err:
            out.append(err.located(source=row.source, key=row.key))
    return out


def _row_sample(row: RawRow, limits: checks.CheckLimits) -> Sample:
    if row.problem is not None:
        raise DataError(*row.problem)
    sample: Sample = {"__key__": row.key}
    if row.image is not None:
        image = checks.prepare_image(row.image, limits)
        sample[image.ext] = image.data
        if image.repairs:  # counted by the job into the manifest's `reencoded`
            sample["__repairs__"] = image.repairs
    if row.text is not None:
        checks.check_text(row.text, limits)
        sample["txt"] = row.text
    if row.label is not None:
        sample["cls"] = str(row.label).encode()
    return sample
