"""What to convert of scenes labelled per point (make_shards pointcloud --layout scans|kitti):
one task per scan, its labels file (if apart) carried in the task's second path.

    --layout kitti SRC: SemanticKITTI, SRC the dataset root (`sequences/NN/`), one sequence,
        or any folder of them: each `velodyne/NNNNNN.bin` with `labels/NNNNNN.label` beside
        its folder; key `<sequence>_<NNNNNN>`
    --layout scans SRC: every .bin/.npy/.ply/.xyz/.off under SRC is a scan; its labels are
        its --label-column, or a `<stem>.label` file beside it; key from the path

Where no scan has labels (no --label-column, no labels file beside any), the scans are
converted as clouds without labels: `KEY.npy` alone, no segmentation section, read with
pointcloud_loader(labels=False). Where some have, a scan whose labels file is missing is a
task all the same: converting it fails with a `missing-labels` error naming it (raised or
skipped by --on-error), so a forgotten file never passes as unlabelled.
"""

from __future__ import annotations

from pathlib import Path

from shardflow.convert.sources import InputItem, Plan, _ext, _walk, make_keys
from shardflow.samples.scans import SCAN_EXTS, ScanOptions


def plan_scans(src: Path, opts: ScanOptions) -> Plan:
    """The tasks of a scan folder or of SemanticKITTI sequences (see the module docstring)."""
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: not a folder of scans")
    rels, ignored = _walk(src)
    if opts.layout == "kitti":
        found, labels = _kitti(rels)
        keys = _unique([_kitti_name(r, src.name) for r in found], found)
    else:
        found = [r for r in rels if _ext(r) in SCAN_EXTS and not r.endswith(".labels.npy")]
        names = set(rels)
        labels = [None if opts.label_column else _beside(r, names) for r in found]
        keys = make_keys(found)
    used = set(found) | {lab for lab in labels if lab}
    ignored += [{"source": str(src / r), "reason": "not-a-scan"} for r in rels if r not in used]
    if not found or not _labelled(src, opts, labels, set(rels)):
        # none labelled: clouds, no label made up (no scan at all: convert/nothing.py says so)
        return Plan("pointcloud", [InputItem(k, str(src / r), "points")
                                   for k, r in zip(keys, found, strict=True)], None, ignored)
    tasks = [InputItem(k, str(src / r), "scan", mask=str(src / lab) if lab else None)
             for k, r, lab in zip(keys, found, labels, strict=True)]
    return Plan("pointcloud", tasks, None, ignored, per_point=True)


def _labelled(src: Path, opts: ScanOptions, labels: list[str | None], names: set[str]
              ) -> bool:
    """Whether the scans are labelled per point: by --label-column, or by a labels file
    beside at least one of them. Options that map labels are refused where there are none."""
    if opts.label_column is not None or any(lab in names for lab in labels if lab):
        return True
    # a learning map sets an ignore label of its own: name the option the user gave
    given = "--learning-map" if opts.learning_map is not None else \
        "--ignore-label" if opts.ignore_label is not None else None
    if given:
        raise ValueError(f"{src}: {given} maps labels, but no scan has any (no .label file "
                         "beside one, no --label-column); leave it out to convert the scans "
                         "without labels")
    return False


def _kitti(rels: list[str]) -> tuple[list[str], list[str | None]]:
    """Each `.../velodyne/X.bin` and its `.../labels/X.label` (None when there is none)."""
    scans = [r for r in rels if _ext(r) == "bin" and r.rpartition("/")[0].endswith("velodyne")]
    labels: list[str | None] = []
    for r in scans:
        folder, _, name = r.rpartition("/")
        label = f"{folder[: -len('velodyne')]}labels/{name[:-4]}.label"
        labels.append(label)  # missing: its conversion says so (missing-labels)
    return scans, labels


def _kitti_name(rel: str, root: str) -> str:
    """`sequences/08/velodyne/000123.bin` -> `08_000123`, the key (the sequence's folder
    name and the scan's); SRC itself is the sequence when it holds `velodyne/`."""
    parts = rel.split("/")
    sequence = parts[-3] if len(parts) >= 3 else root
    return make_keys([f"{sequence}_{parts[-1]}"])[0]


def _unique(keys: list[str], rels: list[str]) -> list[str]:
    """Keys made unique: one that several scans share (a sequence 00 in two folders) gets a
    hash of each scan's own path, so the keys stay stable and distinct."""
    import hashlib

    seen: dict[str, int] = {}
    for key in keys:
        seen[key] = seen.get(key, 0) + 1
    return [k if seen[k] == 1 else f"{k}-{hashlib.sha1(r.encode()).hexdigest()[:10]}"
            for k, r in zip(keys, rels, strict=True)]


def _beside(rel: str, names: set[str]) -> str | None:
    """A SemanticKITTI-style `<stem>.label` next to a scan, if there is one."""
    stem = rel.rsplit(".", 1)[0]
    return f"{stem}.label" if f"{stem}.label" in names else None
