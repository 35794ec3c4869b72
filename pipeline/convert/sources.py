"""Source kinds for make_shards: what to convert, as a sorted list of tasks with stable keys.

A task names one input file (or, for the `shards` kind, one sample already read from a tar;
for the `parquet` kind, a chunk of rows: parquet.py).
`build_samples(task, ...)` runs in a worker process and turns it into samples (dicts keyed by
extension) or DataErrors; it reads only the file it names and executes nothing from it.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import fsspec
from PIL import Image

from shardflow.errors import DataError
from shardflow.samples import checks, masks, scans
from shardflow.shards.listing import regular_file
from shardflow.shards.writer import FileRef, stamp_of

log = logging.getLogger(__name__)
Sample = dict[str, object]
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
TEXT_RANGE_BYTES = 8 * 1024 * 1024
SOURCE_KINDS = ("imagefolder", "manifest", "text", "pointcloud", "shards", "parquet",
                "tabular")


@dataclass(frozen=True)
class InputItem:
    """One input file to convert; `mode` says how (image, text, lines, jsonl, points)."""

    key: str
    path: str
    mode: str
    label: int | None = None
    start: int = 0  # lines/jsonl: the byte range whose lines this task converts
    end: int = -1
    mask: str | None = None  # an image's segmentation mask (manifest --mask-column)


@dataclass(frozen=True)
class TextOptions:
    split_lines: bool = False
    text_field: str = "text"
    # make_shards --tokenizer: documents stored as token ids (text/pretokenized.py); "bytes"
    # or a tokenizer.json. Its sha256 is filled in by ConvertConfig: the file, not its path,
    # decides the output, so a resumed job with another file at that path is refused.
    tokenizer: str | None = None
    tokenizer_sha256: str | None = None


@dataclass
class Plan:
    """What a source holds: tasks in a fixed order, the class map, the files passed over."""

    modality: str
    tasks: list[InputItem]
    classes: dict[str, int] | None = None
    ignored: list[dict[str, str]] = field(default_factory=list)
    per_point: bool = False  # scenes labelled per point: the manifest gets `segmentation`


def make_keys(relpaths: list[str]) -> list[str]:
    """Stable keys from relative paths: no dots or separators; clashes get a path hash."""
    keys = [_UNSAFE.sub("_", _strip_ext(p)).strip("_") or "sample" for p in relpaths]
    counts: dict[str, int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    return [k if counts[k] == 1 else f"{k}-{hashlib.sha1(p.encode()).hexdigest()[:10]}"
            for k, p in zip(keys, relpaths, strict=True)]


def _strip_ext(relpath: str) -> str:
    head, _, base = relpath.rpartition("/")
    stem = base.rsplit(".", 1)[0] if "." in base.lstrip(".") else base
    return f"{head}/{stem}" if head else stem


def _ext(path: str) -> str:
    return path.rsplit(".", 1)[-1].lower() if "." in Path(path).name else ""


def _walk(root: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Relative POSIX paths of the regular files under root, sorted, and what was passed over:
    symbolic links (never followed: a link could lead anywhere on the machine), FIFOs,
    sockets and devices (reading a FIFO blocks forever; a device may never end), and
    folders that cannot be read. Sorted by path components (`a/b` before `a.b`), the order
    pathlib's sort gave: keys and shards stay as they were. os.scandir's entries know their
    type, where pathlib's rglob and sort cost 35 us a file (70 ms of a 2,000-photo run)."""
    found: list[tuple[str, str | None]] = []  # (relative path, why passed over, or None)
    folders = [""]
    while folders:
        rel = folders.pop()
        try:
            with os.scandir(root / rel) as entries:
                for e in entries:
                    path = f"{rel}/{e.name}" if rel else e.name
                    if e.is_symlink():
                        found.append((path, "symlink"))
                    elif e.is_dir(follow_symlinks=False):
                        folders.append(path)
                    else:
                        found.append((path, None if e.is_file(follow_symlinks=False)
                                      else "not-a-regular-file"))
        except PermissionError:
            found.append((rel, "unreadable-folder"))
    found.sort(key=lambda item: item[0].split("/"))
    files = [path for path, why in found if why is None]
    passed = [{"source": str(root / path), "reason": why} for path, why in found if why]
    if passed:
        log.warning("%s: passed over %d symbolic links, FIFOs, devices or unreadable folders "
                    "(e.g. %s); they are listed under 'ignored' in the manifest", root,
                    len(passed), passed[0]["source"])
    return files, passed


def _class_folder_plan(src: Path, exts: tuple[str, ...], mode: str, modality: str,
                       classes: dict[str, int] | None) -> Plan:
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: not a folder (expected one subfolder per class)")
    # no class folder: every file is passed over, and convert/nothing.py says what takes them
    folders = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.is_symlink())
    classes = _class_map(src, folders, classes)
    rels, ignored = _walk(src)
    keep = [r for r in rels if r.split("/", 1)[0] in classes and "/" in r and _ext(r) in exts]
    ignored += [{"source": str(src / r), "reason": f"not-a-class-{modality}"}
                for r in sorted(set(rels) - set(keep))]
    _warn_nested(src, keep)
    tasks = [InputItem(k, str(src / r), mode, classes[r.split("/", 1)[0]])
             for k, r in zip(make_keys(keep), keep, strict=True)]
    return Plan(modality, tasks, classes, ignored)


def _class_map(src: Path, folders: list[str], given: dict[str, int] | None) -> dict[str, int]:
    """Sorted folder names -> 0..n-1, or the map of an earlier conversion (--classes-from),
    so that a validation split numbers its classes like the training split."""
    if given is None:
        return {name: i for i, name in enumerate(folders)}
    unknown = sorted(set(folders) - set(given))
    if unknown:
        raise ValueError(f"{src}: class folders {unknown[:5]} are not in the --classes-from "
                         f"map ({len(given)} classes)")
    return dict(given)


def _warn_nested(src: Path, rels: list[str]) -> None:
    nested = [r for r in rels if r.count("/") > 1]
    if nested:
        log.warning("%s: %d files are in subfolders of class folders (e.g. %s); they are "
                    "converted with their class. Point SRC at one split if these are splits.",
                    src, len(nested), nested[0])


def plan_imagefolder(src: Path, classes: dict[str, int] | None = None) -> Plan:
    return _class_folder_plan(src, checks.IMAGE_EXTS, "image", "image", classes)


def plan_pointcloud(src: Path, classes: dict[str, int] | None = None) -> Plan:
    # .bin too: a LiDAR scan (KITTI's velodyne) in a class folder is a cloud of that class
    return _class_folder_plan(src, scans.SCAN_EXTS, "points", "pointcloud", classes)


def plan_text(src: Path, opts: TextOptions) -> Plan:
    root = src if src.is_dir() else src.parent
    rels, ignored = _walk(src) if src.is_dir() else ([src.name], [])
    ignored += [{"source": str(root / r), "reason": "not-a-text-file"}
                for r in rels if _ext(r) not in ("txt", "jsonl")]
    rels = [r for r in rels if _ext(r) in ("txt", "jsonl")]  # none: convert/nothing.py says so
    tasks = []
    for key, rel in zip(make_keys(rels), rels, strict=True):
        tasks.extend(_text_tasks(key, str(root / rel), _text_mode(rel, opts)))
    return Plan("text", tasks, None, ignored)


def _text_tasks(key: str, path: str, mode: str) -> list[InputItem]:
    """Whole documents are one task; line files are cut into byte ranges so that a big file
    is converted by every worker in bounded memory."""
    if mode == "text":
        return [InputItem(key, path, mode)]
    size = os.path.getsize(path)
    return [InputItem(key, path, mode, None, lo, min(lo + TEXT_RANGE_BYTES, size))
            for lo in range(0, max(size, 1), TEXT_RANGE_BYTES)]


def _text_mode(rel: str, opts: TextOptions) -> str:
    if _ext(rel) == "jsonl":
        return "jsonl"
    return "lines" if opts.split_lines else "text"


def plan_manifest(src: Path, path_column: str, label_column: str,
                  classes: dict[str, int] | None = None, mask_column: str | None = None
                  ) -> Plan:
    rows = _read_rows(src)
    if not rows:
        raise ValueError(f"{src}: the manifest lists no files")
    if path_column not in rows[0]:
        raise ValueError(f"{src}: no column {path_column!r} (columns: {sorted(rows[0])}); "
                         "pass --path-column")
    modality = _manifest_modality(src, [r[path_column] for r in rows])
    labels = [r.get(label_column) for r in rows] if label_column in rows[0] else None
    classes, indices = _label_indices(src, labels, classes)
    paths = [p if "://" in p else str(src.parent / p) for p in (str(r[path_column]) for r in rows)]
    _no_repeats(src, [p if "://" in p else os.path.abspath(p) for p in paths])
    mode = "image" if modality == "image" else "points"
    masks = _mask_paths(src, rows, mask_column, modality) if mask_column else None
    tasks = [InputItem(k, p, mode, indices[i] if indices else None,
                       mask=masks[i] if masks else None)
             for i, (k, p) in enumerate(zip(make_keys(_relative(paths)), paths, strict=True))]
    return Plan(modality, tasks, classes, [])


def _mask_paths(src: Path, rows: list[dict[str, str]], column: str, modality: str
                ) -> list[str]:
    """Each row's mask path (relative paths against the manifest's folder); every image has
    one: a segmentation set with holes would train on unlabelled pixels as background."""
    if modality != "image":
        raise ValueError(f"{src}: --mask-column is for images; these are point clouds")
    if column not in rows[0]:
        raise ValueError(f"{src}: no column {column!r} (columns: {sorted(rows[0])}) for "
                         "--mask-column")
    missing = [i for i, r in enumerate(rows) if not str(r.get(column) or "").strip()]
    if missing:
        raise ValueError(f"{src}: row {missing[0] + 1} has no mask ({len(missing)} rows in "
                         "all); every image needs one")
    paths = [str(r[column]).strip() for r in rows]
    return [p if "://" in p else str(src.parent / p) for p in paths]


def _relative(paths: list[str]) -> list[str]:
    """Paths relative to the deepest folder they share, so keys stay short and stable."""
    local = [urlsplit(p).path if "://" in p else os.path.abspath(p) for p in paths]
    common = os.path.commonpath([os.path.dirname(p) or "/" for p in local])
    return [os.path.relpath(p, common).replace(os.sep, "/") for p in local]


def _read_rows(src: Path) -> list[dict[str, str]]:
    text = src.read_text(encoding="utf-8")
    if src.suffix.lower() == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{src}: line {n} is not JSON ({exc})") from None
        return rows
    return list(csv.DictReader(io.StringIO(text)))


def _manifest_modality(src: Path, paths: list[str]) -> str:
    kinds = {"image" if _ext(p) in checks.IMAGE_EXTS else
             "pointcloud" if _ext(p) in checks.POINTCLOUD_EXTS else "other" for p in paths}
    if len(kinds) != 1 or "other" in kinds:
        raise ValueError(f"{src}: every path must be an image ({', '.join(checks.IMAGE_EXTS)})"
                         f" or every path a point cloud ({', '.join(checks.POINTCLOUD_EXTS)})")
    return kinds.pop()


def _label_indices(src: Path, labels: Sequence[object] | None, given: dict[str, int] | None
                   ) -> tuple[dict[str, int] | None, list[int] | None]:
    """Integer labels are kept; names are mapped to sorted indices (stored as `classes`), or
    to the indices of `given` (the map of an earlier conversion, --classes-from)."""
    if labels is None:
        return None, None
    missing = [i for i, lab in enumerate(labels) if lab is None or str(lab).strip() == ""]
    if missing:
        raise ValueError(f"{src}: row {missing[0] + 1} has no label ({len(missing)} rows in "
                         "all); fill them in or drop the label column")
    names = [str(lab).strip() for lab in labels]
    numeric = [bool(re.fullmatch(r"[+-]?\d+", n)) for n in names]
    if given is None and all(numeric):
        return None, [_index_label(src, i, n) for i, n in enumerate(names)]
    if given is None and any(numeric):
        first = numeric.index(True) if not numeric[0] else numeric.index(False)
        raise ValueError(f"{src}: labels mix integers and class names (row {first + 1}: "
                         f"{names[first]!r}); use one or the other")
    classes = given or {n: i for i, n in enumerate(sorted(set(names)))}
    unknown = [(i, n) for i, n in enumerate(names) if n not in classes]
    if unknown:
        raise ValueError(f"{src}: row {unknown[0][0] + 1} has label {unknown[0][1]!r}, which is "
                         f"not in the --classes-from map ({len(unknown)} such rows)")
    return classes, [classes[n] for n in names]


def _index_label(src: Path, row: int, text: str) -> int:
    if int(text) < 0:
        raise ValueError(f"{src}: row {row + 1} has label {text}; integer labels are class "
                         "indices and must be >= 0")
    return int(text)


def _no_repeats(src: Path, paths: list[str]) -> None:
    first: dict[str, int] = {}
    for i, p in enumerate(paths):
        if p in first:
            raise ValueError(f"{src}: row {i + 1} lists the same file as row {first[p] + 1} "
                             f"({p}); each file may be listed once")
        first[p] = i


# -- the worker side: one task -> samples --------------------------------------------------

def build_samples(task: InputItem, limits: checks.CheckLimits, text: TextOptions,
                  max_file_bytes: int, storage_options: Mapping[str, Any] | None = None,
                  refs: bool = False, scan: scans.ScanOptions | None = None
                  ) -> list[Sample | DataError]:
    """Read and check one task's file (a URL opened with `storage_options`); data errors are
    returned, not raised, per sample. With `refs`, a local image kept as stored is given as
    a FileRef (writer.py), for a worker process to send its path instead of its bytes.
    `scan`: how a scan labelled per point is read (mode "scan": samples/scans.py)."""
    try:
        if task.mode in ("lines", "jsonl"):
            return list(_text_samples(task, limits, text))
        stamp: list[tuple[int, int, int, int]] = []
        data = _read_file(task.path, max_file_bytes, storage_options or {}, stamp)
        if task.mode == "scan":
            return [_scan_sample(task, data, limits, scan or scans.ScanOptions("scans"),
                                 max_file_bytes, storage_options or {})]
        sample = _one_sample(task, data, limits, (scan or scans.ScanOptions()).point_dims)
        if task.mask is not None:
            sample[masks.MASK_EXT] = _mask_member(task.mask, sample, max_file_bytes,
                                                  storage_options or {})
        if refs and stamp and task.mode == "image":
            _refer(sample, data, FileRef(task.path, stamp[0]))
        return [sample]
    except DataError as err:
        return [err.located(source=task.path, key=task.key)]


def _refer(sample: Sample, data: bytes, ref: FileRef) -> None:
    """The image member that is the file's bytes unchanged, as `ref`."""
    for ext, value in sample.items():
        if value is data and len(data) == ref.size:
            sample[ext] = ref
            return


def _read_file(path: str, max_bytes: int, storage_options: Mapping[str, Any],
               stamp: list[tuple[int, int, int, int]] | None = None) -> bytes:
    """The whole file, refusing more than max_bytes without reading past the limit; a local
    file's stamp (writer.FileRef) appended to `stamp` when it held still during the read."""
    regular_file(path)
    try:
        # A local path opens directly: fsspec's URL parsing cost a tenth of the read.
        if "://" not in path:
            with open(path, "rb") as f:
                before = stamp_of(f.fileno()) if stamp is not None else None
                data = _read_local(f, max_bytes)
                if before is not None and stamp_of(f.fileno()) == before:
                    stamp.append(before)  # type: ignore[union-attr]
        else:
            with fsspec.open(path, "rb", **storage_options) as f:
                data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise DataError("missing-file", "the file does not exist") from None
    except IsADirectoryError:
        raise DataError("missing-file", "the path is a folder, not a file") from None
    if len(data) > max_bytes:
        raise DataError("file-too-large", f"more than max_file_bytes={max_bytes} bytes")
    return data


def _read_local(f: BinaryIO, max_bytes: int) -> bytes:
    """Up to max_bytes + 1 bytes of a local file, read into a buffer of the file's size: a
    read(max_bytes + 1) allocates that much first (1 GiB by default: 64 us a photo, against
    12 for the read itself). A file that grew since its size was taken is read on."""
    size = os.fstat(f.fileno()).st_size
    data = f.read(min(size, max_bytes) + 1)
    if len(data) > size:
        data += f.read(max_bytes + 1 - len(data))
    return data


def _mask_member(path: str, sample: Sample, max_file_bytes: int,
                 storage_options: Mapping[str, Any]) -> bytes:
    """The mask file as stored (samples/masks.py), checked against the stored image's size;
    a bad one names the mask's path."""
    image = next(v for k, v in sample.items() if k in checks.IMAGE_EXTS)
    with Image.open(io.BytesIO(image)) as img:  # type: ignore[arg-type]
        size = img.size
    try:
        return masks.prepare_mask(_read_file(path, max_file_bytes, storage_options), size)
    except DataError as err:
        raise DataError(err.reason, f"{err.detail} (mask {path})") from None


def _scan_sample(task: InputItem, data: bytes, limits: checks.CheckLimits,
                 opts: scans.ScanOptions, max_file_bytes: int,
                 storage_options: Mapping[str, Any]) -> Sample:
    """A scan and its labels (from `task.mask`, its labels file, when they are apart)."""
    labels = None
    if task.mask is not None:
        try:
            labels = _read_file(task.mask, max_file_bytes, storage_options)
        except DataError as err:
            raise DataError("missing-labels" if err.reason == "missing-file" else err.reason,
                            f"labels {task.mask}: {err.detail}") from None
    members = scans.scan_members(data, _ext(task.path), labels, opts, limits.max_points)
    return {"__key__": task.key, **members}


def _one_sample(task: InputItem, data: bytes, limits: checks.CheckLimits, point_dims: int
                ) -> Sample:
    sample: Sample = {"__key__": task.key}
    if task.mode == "image":
        image = checks.prepare_image(data, limits)
        sample[image.ext] = image.data
        if image.repairs:  # counted by the job into the manifest's `reencoded`
            sample["__repairs__"] = image.repairs
    elif task.mode == "points" and _ext(task.path) == "bin":  # headerless: --point-dims
        sample.update(scans.cloud_members(data, "bin", point_dims, limits.max_points))
    elif task.mode == "points":
        sample.update(checks.cloud_members(data, _ext(task.path), limits))
    else:
        checks.check_text(data, limits)
        sample["txt"] = data
    if task.label is not None:
        sample["cls"] = str(task.label).encode()
    return sample


def _text_samples(task: InputItem, limits: checks.CheckLimits,
                  opts: TextOptions) -> Iterator[Sample | DataError]:
    """One sample per non-blank line starting in [task.start, task.end); the key carries the
    line's byte offset, which is stable and unique within the file."""
    for offset, line in _lines(task.path, task.start, task.end, limits.max_text_bytes):
        key = f"{task.key}-{offset:012d}"
        try:
            if line is None:
                raise DataError("text-too-large", f"line is longer than max_text_bytes="
                                f"{limits.max_text_bytes}; split it or raise the limit")
            body = _jsonl_text(line, opts.text_field) if task.mode == "jsonl" else line
            checks.check_text(body, limits)
            yield {"__key__": key, "txt": body}
        except DataError as err:
            yield err.located(source=f"{task.path}@{offset}", key=key)


def _lines(path: str, start: int, end: int, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(offset, line without its newline) of each non-blank line that starts in [start, end);
    None for a line over `limit` bytes, which is skipped without being held in memory."""
    regular_file(path, samples=None)
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line holding byte start-1 belongs to the previous range
        while (offset := f.tell()) < end:
            line = f.readline(limit + 1)
            if not line:
                return
            if len(line) > limit and not line.endswith(b"\n"):
                _skip_rest_of_line(f)
                yield offset, None
            elif line.strip():  # blank lines separate documents; they are not inputs
                yield offset, line.rstrip(b"\r\n")


def _skip_rest_of_line(f: io.BufferedReader) -> None:
    while (chunk := f.readline(1 << 20)) and not chunk.endswith(b"\n"):
        pass


def _jsonl_text(line: bytes, field_name: str) -> bytes:
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError("bad-json", f"line is not JSON ({exc})") from None
    value = obj.get(field_name) if isinstance(obj, dict) else None
    if not isinstance(value, str):
        raise DataError("missing-field", f"no string field {field_name!r}; pass --text-field")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON allows lone surrogates, UTF-8 does not
        raise DataError("bad-utf8", f"text holds {value[exc.start]!r}, not encodable as "
                        "UTF-8") from None
