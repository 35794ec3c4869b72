"""The manifest's `segmentation` section: what a conversion of scenes labelled per point
wrote (make_shards pointcloud --layout scans|kitti), for the loader and for people.

    {"num_classes": 6, "ignore_label": 0, "class_names": ["unlabeled", "road", ...],
     "label_counts": {"0": 412, "1": 240311, ...}, "frames": 6,
     "points": 480112, "points_per_frame": {"min": 76012, "max": 84220, "mean": 80018.7}}

`num_classes` is the learning map's, else the largest label other than the ignore label + 1.
The counts are the points per class of every frame written (a frame skipped is not counted),
summed over the parts of a split conversion. Built as plain JSON values, so the journal of an
unfinished job keeps them.
"""

from __future__ import annotations

from typing import Any

Stats = dict[str, Any]


def empty() -> Stats:
    return {"label_counts": {}, "frames": 0, "points": 0, "min": None, "max": None}


def add(stats: Stats, counts: dict[int, int]) -> None:
    """One frame's points per label."""
    for label, n in counts.items():
        stats["label_counts"][str(label)] = stats["label_counts"].get(str(label), 0) + n
    points = sum(counts.values())
    stats["frames"] += 1
    stats["points"] += points
    stats["min"] = points if stats["min"] is None else min(stats["min"], points)
    stats["max"] = points if stats["max"] is None else max(stats["max"], points)


def section(stats: Stats, num_classes: int | None, ignore_label: int | None,
            class_names: list[str] | None) -> dict[str, Any]:
    """The manifest's section from the job's stats and its options."""
    labels = sorted(int(k) for k in stats["label_counts"])
    frames = stats["frames"]
    classes = [k for k in labels if k != ignore_label]  # an ignore label of 255 is no class
    return {
        "num_classes": num_classes if num_classes is not None else
        (classes[-1] + 1 if classes else 0),
        "ignore_label": ignore_label, "class_names": class_names,
        "label_counts": {str(k): stats["label_counts"][str(k)] for k in labels},
        "frames": frames, "points": stats["points"],
        "points_per_frame": {"min": stats["min"], "max": stats["max"],
                             "mean": round(stats["points"] / frames, 1) if frames else None},
    }


def merged(sections: list[dict[str, Any]]) -> dict[str, Any]:
    """The parts' sections as one (the same options in every part: checked by the merge)."""
    stats = empty()
    for s in sections:
        for label, n in s["label_counts"].items():
            stats["label_counts"][label] = stats["label_counts"].get(label, 0) + n
        stats["frames"] += s["frames"]
        stats["points"] += s["points"]
        for name, pick in (("min", min), ("max", max)):
            value = s["points_per_frame"][name]
            if value is not None:
                stats[name] = value if stats[name] is None else pick(stats[name], value)
    first = sections[0]
    num_classes = max(s["num_classes"] for s in sections)
    return section(stats, num_classes, first["ignore_label"], first["class_names"])
