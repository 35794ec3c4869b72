"""The `parquet` source kind: one Parquet file or a folder of them (as Hugging Face datasets
store theirs), an image column (bytes, or HF's {"bytes", "path"} struct) and/or a text column,
an optional label column (integers, or strings numbered in sorted order) and key column.

The main process reads the rows with pyarrow, one row group at a time in row batches (pyarrow
holds the selected columns of the row group it reads, never a whole file), and cuts them into
chunks of at most CHUNK_ROWS rows and about CHUNK_BYTES; workers check a chunk's rows
(`build_rows`: images as the imagefolder kind's, text as the text kind's). A chunk is one task
of the job: where chunks start depends on the files' metadata only, so the journal's position
is exact and a rerun seeks to it. A row group that fails to read becomes one error per chunk
of it (bad-parquet, its rows counted); a bad row (a null image, an empty text, a missing
label) is one error naming the file and its row (0-based). Nothing from the data is executed:
Hugging Face's schema metadata is read with json.loads, and a path in an image struct is never
opened (an image given only by path is a missing-image row).
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.convert.sources import _UNSAFE, Plan, Sample, _ext, _walk, make_keys
from pipeline.errors import DataError
from pipeline.samples import checks

log = logging.getLogger(__name__)

CHUNK_ROWS = 256  # rows per task at most
CHUNK_BYTES = 2 * 1024 * 1024  # and about this many bytes of the selected columns
SHUFFLE_ROWS = 10_000  # --shuffle-seed mixes rows within windows of this many rows
SHUFFLE_BYTES = 256 * 1024 * 1024  # or of about this many bytes, whichever comes first
READ_BUFFER = 1024 * 1024  # pyarrow reads column chunks through a buffer of this size
BIG_GROUP_BYTES = 1024 * 1024 * 1024  # warn: reading holds a row group this big in memory
INSTALL = "the parquet kind needs pyarrow: pip install 'shardflow[parquet]'"
Problem = tuple[str, str]


@dataclass(frozen=True)
class ParquetOptions:
    """Which columns hold what (None: not used)."""

    image_column: str | None = None
    text_column: str | None = None
    label_column: str | None = None
    key_column: str | None = None

    def columns(self) -> list[str]:
        named = (self.image_column, self.text_column, self.label_column, self.key_column)
        return list(dict.fromkeys(c for c in named if c))

    def roles(self) -> list[tuple[str, str]]:
        """(role, column) for each column used: image, text, label, key."""
        return [(role, col) for role, col in (
            ("image", self.image_column), ("text", self.text_column),
            ("label", self.label_column), ("key", self.key_column)) if col]


@dataclass(frozen=True)
class ParquetFileInfo:
    """One input file as its footer describes it."""

    path: str
    prefix: str  # key prefix: the file's relative path made safe
    groups: tuple[int, ...] = ()  # rows of each row group
    chunk_rows: int = 1
    row_bytes: float = 0.0  # average bytes of the selected columns per row
    error: str = ""  # why pyarrow could not read the footer (the file is then one error)

    @property
    def rows(self) -> int:
        return sum(self.groups)


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


@dataclass
class ParquetPlan(Plan):
    """A Plan whose tasks are streamed (`row_tasks`), not listed."""

    files: list[ParquetFileInfo] = field(default_factory=list)
    opts: ParquetOptions = field(default_factory=ParquetOptions)
    label_kind: str | None = None  # "int" or "str"
    num_classes: int | None = None  # integer labels: the bound, when class names are known
    duplicates: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> first

    def part_range(self, part: tuple[int, int]) -> tuple[int, int]:
        total, (index, count) = sum(f.rows for f in self.files), part
        return index * total // count, (index + 1) * total // count

    def part_rows(self, part: tuple[int, int]) -> int:
        lo, hi = self.part_range(part)
        return hi - lo


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(INSTALL) from None
    return pq


# -- planning: files, schemas, labels, keys --------------------------------------------------

def plan_parquet(src: Path, opts: ParquetOptions, given: dict[str, int] | None = None
                 ) -> ParquetPlan:
    """Read every file's footer, check the columns, number string labels, find repeated keys."""
    _pyarrow()
    if not opts.image_column and not opts.text_column:
        raise ValueError("parquet: pass --image-column and/or --text-column (the columns "
                         "holding image bytes or text)")
    if opts.image_column and opts.image_column == opts.text_column:
        raise ValueError(f"parquet: --image-column and --text-column are both "
                         f"{opts.image_column!r}")
    paths, rels, ignored = _parquet_files(src)
    files, kinds, names = [], set(), []
    for path, prefix in zip(paths, make_keys(rels), strict=True):
        info, kind, hf_names = _open_file(path, prefix, opts)
        files.append(info)
        kinds |= {kind} - {None}
        names += [(path, hf_names)] if hf_names is not None else []
    if len(kinds) > 1:
        raise ValueError(f"{src}: the label column {opts.label_column!r} holds integers in some "
                         "files and strings in others")
    plan = ParquetPlan("image" if opts.image_column else "text", [], None, ignored,
                       files=files, opts=opts, label_kind=kinds.pop() if kinds else None)
    _number_labels(plan, src, names, given)
    if opts.key_column:
        plan.duplicates = _repeated_keys(plan)
    return plan


def _parquet_files(src: Path) -> tuple[list[str], list[str], list[dict[str, str]]]:
    """The .parquet files under a folder (sorted, recursive; links passed over), the file, or
    the files a glob pattern matches (one split of a Hugging Face dataset: data/train-*)."""
    if src.is_dir():
        rels, ignored = _walk(src)
        ignored += [{"source": str(src / r), "reason": "not-a-parquet-file"}
                    for r in rels if _ext(r) != "parquet"]
        rels = [r for r in rels if _ext(r) == "parquet"]
        root = src
    elif src.is_file():
        rels, ignored, root = [src.name], [], src.parent
    elif any(c in str(src) for c in "*?["):
        root, rels, ignored = _glob(src)
    else:
        raise FileNotFoundError(f"{src}: no such file or folder")
    if not rels:
        raise ValueError(f"{src}: no .parquet files to convert")
    return [str(root / r) for r in rels], rels, ignored


def _glob(pattern: Path) -> tuple[Path, list[str], list[dict[str, str]]]:
    """The regular files a pattern matches ("**" included), relative to the folder above its
    first wildcard, sorted; links and FIFOs passed over as a folder's are."""
    root = Path(*itertools.takewhile(lambda part: not any(c in part for c in "*?["),
                                     pattern.parts)) if pattern.parts else Path(".")
    rels, ignored = [], []
    for path in sorted(Path(p) for p in glob.glob(str(pattern), recursive=True)):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            ignored.append({"source": str(path), "reason": "symlink" if path.is_symlink()
                            else "not-a-regular-file"})
        elif path.is_file():
            rels.append(path.relative_to(root).as_posix())
    return root, rels, ignored


def _open_file(path: str, prefix: str, opts: ParquetOptions
               ) -> tuple[ParquetFileInfo, str | None, list[str] | None]:
    """The file's info, its label kind ("int"/"str") and Hugging Face class names, if any.
    A footer pyarrow cannot read makes the file one bad input; a missing column or one of
    the wrong type is a usage error."""
    import pyarrow as pa

    pq = _pyarrow()
    try:
        with pq.ParquetFile(path) as pf:
            schema, meta = pf.schema_arrow, pf.metadata
    except (pa.ArrowException, OSError) as exc:
        return ParquetFileInfo(path, prefix, error=str(exc)), None, None
    missing = [c for c in opts.columns() if schema.get_field_index(c) < 0]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r}; its columns are "
                         f"{', '.join(map(repr, schema.names))}")
    kinds = {role: _column_kind(path, role, col, schema.field(col).type)
             for role, col in opts.roles()}
    groups = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
    row_bytes = _selected_bytes(path, meta, opts.columns()) / max(sum(groups), 1)
    chunk = max(1, min(CHUNK_ROWS, int(CHUNK_BYTES // max(row_bytes, 1.0))))
    names = _hf_class_names(schema, opts.label_column) if kinds.get("label") == "int" else None
    return (ParquetFileInfo(path, prefix, groups, chunk, row_bytes), kinds.get("label"),
            names)


def _column_kind(path: str, role: str, column: str, dtype: Any) -> str:
    """"bytes", "struct", "str" or "int" for a column type its role takes; else ValueError."""
    import pyarrow as pa

    t = pa.types
    if t.is_dictionary(dtype):
        dtype = dtype.value_type
    binary = t.is_binary(dtype) or t.is_large_binary(dtype) or t.is_fixed_size_binary(dtype) \
        or t.is_binary_view(dtype)
    string = t.is_string(dtype) or t.is_large_string(dtype) or t.is_string_view(dtype)
    if role == "image" and binary:
        return "bytes"
    if role == "image" and t.is_struct(dtype) and dtype.get_field_index("bytes") >= 0:
        inner = dtype.field(dtype.get_field_index("bytes")).type
        if t.is_binary(inner) or t.is_large_binary(inner) or t.is_binary_view(inner):
            return "struct"
    if role == "text" and (string or binary):
        return "str"
    if role in ("label", "key") and (string or t.is_integer(dtype)):
        return "str" if string else "int"
    wanted = {"image": "binary, or a struct with a binary 'bytes' field (Hugging Face Image)",
              "text": "string", "label": "integer or string", "key": "string or integer"}
    raise ValueError(f"{path}: column {column!r} is {dtype}; --{role}-column needs "
                     f"{wanted[role]}")


def _selected_bytes(path: str, meta: Any, columns: list[str]) -> int:
    """Uncompressed bytes of the selected columns (warning about huge row groups)."""
    total = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        size = sum(group.column(j).total_uncompressed_size for j in range(group.num_columns)
                   if group.column(j).path_in_schema.split(".")[0] in columns
                   or group.column(j).path_in_schema in columns)
        if size > BIG_GROUP_BYTES:
            log.warning("%s: row group %d holds %.1f GB of the selected columns; reading "
                        "holds a row group in memory (rewrite it with smaller row groups)",
                        path, g, size / 1e9)
        total += size
    return total


def _hf_class_names(schema: Any, column: str | None) -> list[str] | None:
    """The names of a Hugging Face ClassLabel column, from the schema's JSON metadata."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw or not column:
        return None
    try:
        feature = json.loads(raw)["info"]["features"][column]
        names = feature["names"] if feature.get("_type") == "ClassLabel" else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) \
            or len(set(names)) != len(names):
        return None
    return names


def _number_labels(plan: ParquetPlan, src: Path, names: list[tuple[str, list[str]]],
                   given: dict[str, int] | None) -> None:
    """Integer labels are kept (with Hugging Face's class names as the class map, when the
    files carry them); strings are numbered in sorted order over all files (every --part
    agrees), or as in an earlier conversion's map (--classes-from)."""
    if given is not None and plan.label_kind is None:
        raise ValueError(f"{src}: --classes-from numbers labels; pass --label-column too")
    if plan.label_kind == "int":
        if given is not None:
            raise ValueError(f"{src}: --classes-from maps class names, but the label column "
                             f"{plan.opts.label_column!r} holds integers (kept as they are)")
        if names:
            if any(n != names[0][1] for _, n in names):
                other = next(p for p, n in names if n != names[0][1])
                raise ValueError(f"{other}: its class names differ from {names[0][0]}'s")
            plan.classes = {name: i for i, name in enumerate(names[0][1])}
            plan.num_classes = len(names[0][1])
        return
    if plan.label_kind != "str":
        return
    found = _distinct_labels(plan)
    if given is None:
        plan.classes = {name: i for i, name in enumerate(sorted(found))}
        return
    unknown = sorted(found - set(given))
    if unknown:
        raise ValueError(f"{src}: labels {unknown[:5]} are not in the --classes-from map "
                         f"({len(given)} classes; {len(unknown)} unknown labels)")
    plan.classes = dict(given)


def _scan(plan: ParquetPlan, column: str) -> Iterator[tuple[int, int, list[Any]]]:
    """(file index, first row, values) over one column of every readable file; row groups
    that fail to read are passed over here (the conversion reports them)."""
    import pyarrow as pa

    pq = _pyarrow()
    for f, info in enumerate(plan.files):
        if info.error:
            continue
        with pq.ParquetFile(info.path, buffer_size=READ_BUFFER, pre_buffer=False) as pf:
            group_first = 0
            for g, rows in enumerate(info.groups):
                first = group_first
                try:
                    for batch in pf.iter_batches(batch_size=65_536, row_groups=[g],
                                                 columns=[column], use_threads=False):
                        values = _to_list(batch.column(0), "label")
                        yield f, first, values
                        first += len(values)
                except (pa.ArrowException, OSError, UnicodeDecodeError):
                    pass
                group_first += rows


def _distinct_labels(plan: ParquetPlan) -> set[str]:
    found: set[str] = set()
    for _, _, values in _scan(plan, str(plan.opts.label_column)):
        found.update(v for v in values if isinstance(v, str) and v.strip())
    return found


def _repeated_keys(plan: ParquetPlan) -> dict[str, tuple[int, int]]:
    """Keys (made safe) that more than one row has -> the (file, row) that keeps it: the
    first in file order. One pass over the key column, holding every key once."""
    first: dict[str, tuple[int, int]] = {}
    repeated: dict[str, tuple[int, int]] = {}
    for f, row, values in _scan(plan, str(plan.opts.key_column)):
        for i, value in enumerate(values):
            key = safe_key(value)
            if key and first.setdefault(key, (f, row + i)) != (f, row + i):
                repeated[key] = first[key]
    return repeated


def safe_key(value: object) -> str:
    """A key column's value as a sample key: no dots, separators or spaces ("" for null)."""
    return "" if value is None else _UNSAFE.sub("_", str(value)).strip("_")


# -- the stream of tasks ----------------------------------------------------------------------

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


def _to_list(column: Any, role: str) -> list[Any]:
    """A column's values as Python objects: image and text as bytes (a struct's 'bytes'
    field, null where the struct is), labels and keys as int or str."""
    import pyarrow as pa

    out: list[Any] = []
    for chunk in getattr(column, "chunks", [column]):
        if pa.types.is_dictionary(chunk.type):
            chunk = chunk.dictionary_decode()
        if pa.types.is_struct(chunk.type):  # flatten() applies the struct's own nulls
            chunk = chunk.flatten()[chunk.type.get_field_index("bytes")]
        elif role == "text" and pa.types.is_string(chunk.type):
            chunk = chunk.cast(pa.binary())  # bytes as stored: check_text judges the UTF-8
        elif role == "text" and pa.types.is_large_string(chunk.type):
            chunk = chunk.cast(pa.large_binary())
        elif role == "text" and pa.types.is_string_view(chunk.type):
            chunk = chunk.cast(pa.binary_view())
        out.extend(chunk.to_pylist())
    return out


def _row_chunk(plan: ParquetPlan, f: int, spec: _Chunk, table: Any) -> RowChunk:
    values = {role: _to_list(table.column(col), role) for role, col in plan.opts.roles()}
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
