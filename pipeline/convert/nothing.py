"""A conversion that writes no sample is refused: the one place that decides it, and says why.

    0 samples written (every file passed over as not of this kind, every input bad and
    skipped, an empty slice of --part, an empty source) and not allow_empty
      -> ValueError (make_shards exit 2, a usage error: the kind, layout or SRC selects
         nothing; as the planners' "no .parquet files"):
         what was passed over and skipped, counted by reason with a few names each, and
         the kind or layout that takes the files passed over

A run that converted nothing was, before this, "0 shards, 0 samples" and exit 0: a script
went on to train on nothing. The check runs before the manifest is written, so OUT is not
marked finished and the corrected command needs no --overwrite; where the plan holds no task
it runs before OUT is touched at all, so --overwrite has deleted nothing yet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardflow.convert.config import ConvertConfig
from shardflow.convert.sources import Plan, _ext
from shardflow.samples import checks
from shardflow.urls import redact

EXAMPLES = 3  # names shown per reason

_BIN = ("`pointcloud` (in class folders: a label per cloud; `--layout scans`: scans "
        "labelled per point, or unlabelled where none has labels; `--point-dims`, default 4: "
        "KITTI's x y z remission)")
# The kind (and layout) that takes files of an extension, for the hint.
TAKES = {**{e: "`imagefolder` (one subfolder per class) or `manifest`"
            for e in checks.IMAGE_EXTS},
         **{e: "`pointcloud` (one subfolder per class)" for e in checks.POINTCLOUD_EXTS},
         "bin": _BIN, "label": "`pointcloud --layout scans|kitti` (a scan's labels per point)",
         "txt": "`text`", "jsonl": "`text`", "parquet": "`parquet` or `tabular`",
         "csv": "`tabular` (rows) or `manifest` (a list of paths)", "tsv": "`tabular`",
         "gz": "`tabular` (gzipped CSV/TSV)", "tar": "`shards`", "tgz": "`shards`"}


def refuse_empty(cfg: ConvertConfig, plan: Plan, skipped: Sequence[dict[str, Any]],
                 written: int) -> None:
    """ValueError describing the run when it wrote no sample, unless cfg.allow_empty."""
    if written or cfg.allow_empty:
        return
    raise ValueError(describe(cfg, plan, skipped))


def describe(cfg: ConvertConfig, plan: Plan, skipped: Sequence[dict[str, Any]]) -> str:
    root = str(Path(cfg.src)) + "/"
    lines = [f"{redact(cfg.src)}: nothing converted: 0 samples ({_what(cfg)})"]
    if plan.ignored:
        lines.append(f"passed over {len(plan.ignored)} files that are not inputs of this kind: "
                     + _by_reason(plan.ignored, root))
    if skipped:
        lines.append(f"skipped {len(skipped)} bad inputs: " + _by_reason(skipped, root)
                     + f"; first: {skipped[0].get('detail', '')}")
    lines += _hints(cfg, plan, root)
    if not plan.ignored and not skipped and cfg.part[1] == 1:
        lines.append("its inputs hold no sample (an empty folder, or shards, tables or "
                     "files with none)")
    lines.append("pass --allow-empty to write an empty dataset all the same")
    return "\n".join(lines)


def _what(cfg: ConvertConfig) -> str:
    layout = f" --layout {cfg.scan.layout}" if cfg.kind == "pointcloud" else ""
    part = f" --part {cfg.part[0]}/{cfg.part[1]}" if cfg.part[1] > 1 else ""
    return f"{cfg.kind}{layout}{part}"


def _by_reason(entries: Sequence[dict[str, Any]], root: str) -> str:
    """`reason=count (name, name, ...)` for each reason, the names relative to SRC."""
    names: dict[str, list[str]] = {}
    for e in entries:
        source = str(e.get("source", ""))
        name = source[len(root):] if source.startswith(root) else redact(source)
        names.setdefault(str(e["reason"]), []).append(name)
    return ", ".join(f"{reason}={len(found)} ({', '.join(found[:EXAMPLES])}"
                     f"{', ...' if len(found) > EXAMPLES else ''})"
                     for reason, found in sorted(names.items()))


def _hints(cfg: ConvertConfig, plan: Plan, root: str) -> list[str]:
    """What would take the files passed over: the kind per extension, and for a class-folder
    kind the files that lie directly under SRC; an empty slice of --part."""
    files = [str(e["source"]) for e in plan.ignored if str(e["reason"]).startswith("not-a-")]
    exts = Counter(_ext(f) for f in files)
    hints = [f"{n} .{ext} files: convert them with {TAKES[ext]}"
             for ext, n in exts.most_common()
             if ext in TAKES and not TAKES[ext].startswith(f"`{cfg.kind}`")]  # another kind
    if cfg.kind == "pointcloud" and cfg.scan.layout == "kitti":
        hints.append("`--layout kitti` takes sequences/NN/velodyne/*.bin (labels in "
                     "labels/*.label); `--layout scans` takes every scan under SRC")
    loose = [f for f in files if "/" not in f[len(root):]]
    if loose and cfg.kind in ("imagefolder", "pointcloud") and not cfg.scan.per_point:
        hints.append(f"{len(loose)} files lie directly under SRC: a class-folder kind takes "
                     "SRC/<class>/<file>" + (" (or `--layout scans`: no classes)"
                                             if cfg.kind == "pointcloud" else ""))
    if cfg.part[1] > 1:
        hints.append(f"--part {cfg.part[0]}/{cfg.part[1]} converts one slice of the inputs; "
                     "with fewer inputs than parts a slice holds none (--allow-empty writes "
                     "its empty manifest, for merge)")
    return hints
