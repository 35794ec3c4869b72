"""The `tabular` source kind: click logs and other tables (CSV/TSV, gzip or not, and Parquet)
-> blocks of rows, one `.npz` member per block (pipeline/samples/tabular_block.py).

    options (columns, --preset criteo|avazu, --names for headerless files, --delimiter)
      -> plan_tabular: the files, each one's header read and its columns found
      -> tabular_rows.py: rows read in order in the main process, cut into blocks of
         rows_per_block rows (a block may span files), parsed and checked in the workers

Text files: the delimiter comes from the extension (.csv: comma, .tsv/.tab: tab; `.gz` is
looked through) or `--delimiter`; comma (and other) separated files follow CSV quoting (a
quoted field may hold the delimiter, quotes and newlines), tab separated ones are split on
every tab (no quoting, as TSV has none). A UTF-8 byte order mark and CRLF line ends are
taken off. Without `--names` each file's first line is its header (files may order their
columns differently); with `--names` no file has one.
"""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardflow.convert.parquet import _glob
from shardflow.convert.sources import Plan, _walk, make_keys
from shardflow.samples.tabular_block import TabularSchema

log = logging.getLogger(__name__)

TEXT_EXTS = ("csv", "tsv", "tab", "txt")
PARQUET_INSTALL = "Parquet input needs pyarrow: pip install 'shardflow[parquet]'"
CRITEO_NAMES = ("label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))
AVAZU_CATEGORICAL = (
    "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
    "app_domain", "app_category", "device_id", "device_ip", "device_model", "device_type",
    "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21")
# What each preset sets (where the options leave it unset).
PRESETS: dict[str, dict[str, Any]] = {
    "criteo": {"names": CRITEO_NAMES, "delimiter": "\t", "label_column": "label",
               "dense_columns": CRITEO_NAMES[1:14], "categorical_columns": CRITEO_NAMES[14:]},
    "avazu": {"delimiter": ",", "label_column": "click", "dense_columns": (),
              "categorical_columns": AVAZU_CATEGORICAL},
}
MAX_ROWS_PER_BLOCK = 1 << 20


@dataclass(frozen=True)
class TabularOptions:
    """Which columns are what, how text files are split, and the block size."""

    label_column: str | None = None
    dense_columns: tuple[str, ...] = ()
    categorical_columns: tuple[str, ...] = ()
    names: tuple[str, ...] | None = None  # headerless text files: their columns in order
    delimiter: str | None = None  # None: by extension (.csv ",", .tsv/.tab tab)
    rows_per_block: int = 4096
    preset: str | None = None  # "criteo" or "avazu": fills in what is not given
    max_row_bytes: int = 1024 * 1024  # a longer line is a bad row (read in bounded memory)

    def resolved(self) -> TabularOptions:
        """The options with the preset's values where none were given."""
        if self.preset is None:
            return self
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r}: choose one of {', '.join(PRESETS)}")
        given = {k: v for k, v in PRESETS[self.preset].items() if not getattr(self, k)}
        return replace(self, **given)

    def validate(self) -> None:
        """Raise ValueError naming the option and the fix (called for the tabular kind)."""
        if not self.label_column:
            raise ValueError("tabular: pass --label-column (or --preset, or --schema)")
        if not self.dense_columns and not self.categorical_columns:
            raise ValueError("tabular: pass --dense-columns and/or --categorical-columns")
        columns = [self.label_column, *self.dense_columns, *self.categorical_columns]
        twice = sorted({c for c in columns if columns.count(c) > 1})
        if twice:
            raise ValueError(f"tabular: columns {twice} are named more than once among the "
                             "label, dense and categorical columns")
        if self.names is not None:
            missing = [c for c in columns if c not in self.names]
            if missing or len(set(self.names)) != len(self.names):
                raise ValueError(f"tabular: --names must name each column once and include "
                                 f"every column used (missing: {missing})")
        if self.delimiter is not None and (len(self.delimiter) != 1 or self.delimiter in
                                           "\r\n\"" or self.delimiter.isalnum()):
            raise ValueError(f"delimiter={self.delimiter!r}: one character, not a letter, "
                             "digit, quote or line end (e.g. ',' or '\\t')")
        if not 1 <= self.rows_per_block <= MAX_ROWS_PER_BLOCK:
            raise ValueError(f"rows_per_block={self.rows_per_block}: from 1 to "
                             f"{MAX_ROWS_PER_BLOCK} (1024-8192 suits most tables)")
        if self.max_row_bytes < 1:
            raise ValueError(f"max_row_bytes={self.max_row_bytes}: must be at least 1")

    def schema(self) -> TabularSchema:
        assert self.label_column
        return TabularSchema(self.label_column, tuple(self.dense_columns),
                             tuple(self.categorical_columns))


def options_from_schema_file(path: str, base: TabularOptions) -> TabularOptions:
    """`--schema schema.json`: {"label": ..., "dense": [...], "categorical": [...]} and
    optionally "names" (headerless files) and "delimiter"; flags given beside it win."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--schema {path}: cannot read it as JSON ({exc})") from None
    known = {"label", "dense", "categorical", "names", "delimiter"}
    if not isinstance(doc, dict) or set(doc) - known:
        raise ValueError(f"--schema {path}: expected an object with keys among "
                         f"{sorted(known)}, got {sorted(doc) if isinstance(doc, dict) else doc!r}")
    for name in ("dense", "categorical", "names"):
        if not isinstance(doc.get(name, []), list) or \
                not all(isinstance(v, str) for v in doc.get(name, [])):
            raise ValueError(f"--schema {path}: {name!r} must be a list of column names")
    fields: dict[str, Any] = {
        "label_column": doc.get("label"), "dense_columns": tuple(doc.get("dense", ())),
        "categorical_columns": tuple(doc.get("categorical", ())),
        "names": tuple(doc["names"]) if doc.get("names") else None,
        "delimiter": doc.get("delimiter")}
    return replace(base, **{k: v for k, v in fields.items() if not getattr(base, k)})


# -- planning ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TableFile:
    """One input file: how to read it and where its columns are. `take` lists the record's
    field indices of (label, dense..., categorical...); `width` is its field count."""

    path: str
    prefix: str  # block keys start with it (the file's relative path made safe)
    fmt: str  # "text" or "parquet"
    delimiter: str = ","
    quoting: bool = True
    header: bool = False
    width: int = 0
    take: tuple[int, ...] = ()
    error: str = ""  # why the file could not be opened (it is then one bad input)

    def opener(self) -> Any:
        return gzip.open if self.path.endswith(".gz") else open


@dataclass
class TabularPlan(Plan):
    """A Plan whose tasks (blocks) are streamed by tabular_rows.block_tasks."""

    files: list[TableFile] = field(default_factory=list)
    opts: TabularOptions = field(default_factory=TabularOptions)

    @property
    def schema(self) -> TabularSchema:
        return self.opts.schema()


def plan_tabular(src: Path, opts: TabularOptions) -> TabularPlan:
    """The files under `src` in sorted order, each one's columns found (a column missing from
    a file, or of the wrong Parquet type, stops here naming the file and its columns)."""
    paths, rels, ignored = _table_files(src)
    # Keys from the names without .gz (day_1.tsv.gz -> day_1), unless that makes two alike.
    bases = [r[:-3] if r.lower().endswith(".gz") else r for r in rels]
    files = []
    for path, prefix in zip(paths, make_keys(bases if len(set(bases)) == len(bases) else rels),
                            strict=True):
        if _ext(path) == "parquet":
            files.append(_parquet_file(path, prefix, opts))
        else:
            info = _text_file(path, prefix, opts)
            if info is None:
                ignored.append({"source": path, "reason": "empty-file"})
            else:
                files.append(info)
    return TabularPlan("tabular", [], None, ignored, files=files, opts=opts)


def _ext(path: str) -> str:
    """The extension that says the format, looking through .gz (data.csv.gz -> csv)."""
    name = Path(path).name.lower().removesuffix(".gz")
    return name.rsplit(".", 1)[-1] if "." in name else ""


def _table_files(src: Path) -> tuple[list[str], list[str], list[dict[str, str]]]:
    """Files under a folder (sorted, recursive; links passed over; other extensions listed
    under ignored), the file itself, or the files a glob pattern matches."""
    if src.is_dir():
        rels, ignored = _walk(src)
        root, keep = src, [r for r in rels if _input_name(r)]
        ignored += [{"source": str(src / r), "reason": "not-a-table-file"}
                    for r in rels if r not in keep]
        rels = keep
    elif src.is_file():
        root, rels, ignored = src.parent, [src.name], []
    elif any(c in str(src) for c in "*?["):
        root, rels, ignored = _glob(src)
    else:
        raise FileNotFoundError(f"{src}: no such file or folder")
    if not rels:
        raise ValueError(f"{src}: no .csv, .tsv, .txt or .parquet files (gzip or not) to convert")
    return [str(root / r) for r in rels], rels, ignored


def _input_name(rel: str) -> bool:
    return _ext(rel) in (*TEXT_EXTS, "parquet") or rel.lower().endswith(".gz")


def _text_file(path: str, prefix: str, opts: TabularOptions) -> TableFile | None:
    """The file's delimiter and column positions (its header read, unless --names); None for
    a file holding no line at all."""
    delimiter = opts.delimiter or {"csv": ",", "tsv": "\t", "tab": "\t"}.get(_ext(path))
    if delimiter is None:
        raise ValueError(f"{path}: the extension does not say how fields are separated; pass "
                         "--delimiter (e.g. --delimiter ',' or --delimiter '\\t')")
    info = TableFile(path, prefix, "text", delimiter, quoting=delimiter != "\t",
                     header=opts.names is None)
    columns = opts.names
    if columns is None:
        try:
            columns = _read_header(info)
        except (OSError, EOFError, UnicodeDecodeError) as exc:
            return replace(info, error=f"cannot read its header: {exc}")
        if columns is None:
            return None
    return replace(info, width=len(columns), take=_positions(path, columns, opts))


def _read_header(info: TableFile) -> tuple[str, ...] | None:
    import csv

    with info.opener()(info.path, "rb") as f:
        line = f.readline(1024 * 1024)
    if not line.strip():
        return None
    text = line.decode("utf-8").removeprefix("\ufeff").rstrip("\r\n")
    if info.quoting:
        return tuple(next(csv.reader([text], delimiter=info.delimiter)))
    return tuple(text.split(info.delimiter))


def _positions(path: str, columns: tuple[str, ...], opts: TabularOptions) -> tuple[int, ...]:
    wanted = [opts.label_column or "", *opts.dense_columns, *opts.categorical_columns]
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r}; its columns are "
                         f"{', '.join(map(repr, columns[:60]))}"
                         + (" (a headerless file? pass --names)" if opts.names is None else ""))
    twice = [c for c in wanted if columns.count(c) > 1]
    if twice:
        raise ValueError(f"{path}: column {twice[0]!r} appears more than once in its header")
    return tuple(columns.index(c) for c in wanted)


def _parquet_file(path: str, prefix: str, opts: TabularOptions) -> TableFile:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(PARQUET_INSTALL) from None
    try:
        with pq.ParquetFile(path) as pf:
            schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as exc:
        return TableFile(path, prefix, "parquet", error=f"pyarrow cannot read it: {exc}")
    wanted = [opts.label_column or "", *opts.dense_columns, *opts.categorical_columns]
    missing = [c for c in wanted if schema.get_field_index(c) < 0]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r}; its columns are "
                         f"{', '.join(map(repr, schema.names[:60]))}")
    for role, names in (("label", [wanted[0]]), ("dense", opts.dense_columns),
                        ("categorical", opts.categorical_columns)):
        for name in names:
            _check_type(path, role, name, schema.field(name).type)
    return TableFile(path, prefix, "parquet", width=len(wanted),
                     take=tuple(range(len(wanted))))


def _check_type(path: str, role: str, column: str, dtype: Any) -> None:
    import pyarrow as pa

    t = pa.types
    if t.is_dictionary(dtype):
        dtype = dtype.value_type
    text = t.is_string(dtype) or t.is_large_string(dtype) or t.is_binary(dtype) \
        or t.is_large_binary(dtype)
    number = t.is_integer(dtype) or t.is_floating(dtype) or t.is_boolean(dtype) \
        or t.is_decimal(dtype)
    ok = {"label": number or text, "dense": number,
          "categorical": text or t.is_integer(dtype) or t.is_boolean(dtype)}[role]
    if not ok:
        hint = " (a float column is a dense feature: list it under --dense-columns)" \
            if role == "categorical" and t.is_floating(dtype) else ""
        raise ValueError(f"{path}: column {column!r} is {dtype}, which a {role} column cannot "
                         f"be{hint}")
