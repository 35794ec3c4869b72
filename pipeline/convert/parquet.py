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

This module plans (files, columns, labels, keys: `plan_parquet`); parquet_rows.py streams
the chunks (`row_tasks`) and checks their rows (`build_rows`).
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardflow.convert.sources import _UNSAFE, Plan, _ext, _walk, make_keys

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
                        values = to_list(batch.column(0), "label")
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


def to_list(column: Any, role: str) -> list[Any]:
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
