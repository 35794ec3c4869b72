#!/usr/bin/env python3
"""Soak: the image, text and point-cloud loaders for many epochs each, then image training
for many steps, watching resident memory, open file descriptors and threads; JSON and a PNG
chart.

    shardflow soak --out soak-out [--epochs 30] [--steps 1500]

Not a test: it takes minutes. Memory growth per epoch should be zero within noise.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from shardflow.tools.util import positive_int, setup_logging


def reading() -> dict[str, float]:
    gc.collect()  # count what is kept, not garbage not yet collected
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    return {"t": time.monotonic(), "rss_mb": round(rss, 1),
            "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}


def soak_loader(modality: str, shards: Path, epochs: int) -> list[dict[str, float]]:
    from shardflow.image.loader import image_loader
    from shardflow.pointcloud.loader import pointcloud_loader
    from shardflow.text.loader import text_loader

    make = {"image": lambda: image_loader(shards, batch_size=32, device="auto"),
            "text": lambda: text_loader(shards, batch_size=32, seq_len=128, device="auto"),
            "pointcloud": lambda: pointcloud_loader(shards, batch_size=32, num_points=512,
                                                    voxels="occupancy", grid=16,
                                                    device="auto")}[modality]
    points = [reading()]
    with make() as loader:
        for epoch in range(epochs):
            for _ in loader:
                pass
            points.append({**reading(), "epoch": epoch + 1})
    return points


def make_shards(out: Path, images: int) -> dict[str, Path]:
    """The built-in data of each modality as shards under `out`."""
    from shardflow.builtin import make_image_folder, make_pointcloud_folder, make_text_corpus
    from shardflow.convert import ConvertConfig, convert

    sources = {"image": ("imagefolder", make_image_folder(out / "images",
                                                          per_class=max(images // 10, 1))),
               "text": ("text", make_text_corpus(out / "docs", docs=600)),
               "pointcloud": ("pointcloud", make_pointcloud_folder(out / "clouds", per_class=50,
                                                                   points=1024))}
    shards = {}
    for modality, (kind, src) in sources.items():
        shards[modality] = out / f"{modality}-shards"
        convert(ConvertConfig(kind=kind, src=str(src), out=str(shards[modality]), max_count=50,
                              shuffle_seed=0))
    return shards


def soak_training(shards: Path, run: Path, steps: int) -> list[dict[str, float]]:
    import torch

    from shardflow.image.loader import ImageConfig, ImageLoader
    from shardflow.loading.shardlist import resolve_source
    from shardflow.trainers.image_task import ImageClassification
    from shardflow.trainers.loop import TrainConfig, Trainer
    from shardflow.trainers.run import fit

    source, points = resolve_source(shards), [reading()]
    loader = ImageLoader(source, ImageConfig(batch_size=32, size=48, device="cpu"), 0, 1)
    task = ImageClassification(len(source.classes or {}) or 10, device=torch.device("cpu"))
    chunk = max(steps // 10, 1)
    for upto in range(chunk, steps + 1, chunk):  # resume in chunks: checkpoints, reloads
        cfg = TrainConfig(run_dir=run, steps=upto, checkpoint_every=chunk, log_every=chunk)
        fit(Trainer(task, loader, cfg, torch.device("cpu"), {"data": source.fingerprint()}))
        points.append({**reading(), "step": upto})
    loader.close()
    return points


def chart(loaders: dict[str, list[dict[str, Any]]], training: list[dict[str, Any]],
          path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(points, "epoch", f"{modality} loader epoch") for modality, points in loaders.items()]
    rows.append((training, "step", "image training step"))
    fig, axes = plt.subplots(len(rows), 3, figsize=(12, 2.6 * len(rows)), squeeze=False)
    for row, (points, xkey, label) in enumerate(rows):
        xs = [p.get(xkey, 0) for p in points]
        for col, key in enumerate(("rss_mb", "fds", "threads")):
            axes[row][col].plot(xs, [p[key] for p in points], marker="o")
            axes[row][col].set_xlabel(label)
            axes[row][col].set_ylabel(key)
    fig.suptitle("shardflow soak: resident memory, open files, threads")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def growth(points: list[dict[str, Any]], key: str) -> float:
    """Per-interval growth over the second half (the first intervals warm caches up)."""
    half = points[len(points) // 2:]
    return (half[-1][key] - half[0][key]) / max(len(half) - 1, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("soak-out"))
    p.add_argument("--epochs", type=positive_int, default=30)
    p.add_argument("--steps", type=positive_int, default=1500)
    p.add_argument("--images", type=positive_int, default=600)
    args = p.parse_args(argv)
    setup_logging(quiet=True)
    import shutil

    shutil.rmtree(args.out, ignore_errors=True)
    shards = make_shards(args.out, args.images)
    loaders = {m: soak_loader(m, path, args.epochs) for m, path in shards.items()}
    training_points = soak_training(shards["image"], args.out / "run", args.steps)
    result: dict[str, Any] = {"loaders": loaders, "training": training_points}
    for modality, points in loaders.items():
        result[f"{modality}_loader_rss_growth_mb_per_epoch"] = round(growth(points, "rss_mb"), 2)
        result[f"{modality}_loader_fds_first_last"] = [points[1]["fds"], points[-1]["fds"]]
        result[f"{modality}_loader_threads_first_last"] = [points[1]["threads"],
                                                           points[-1]["threads"]]
    result["training_rss_growth_mb_per_chunk"] = round(growth(training_points, "rss_mb"), 2)
    result["training_rss_first_last_mb"] = [training_points[1]["rss_mb"],
                                            training_points[-1]["rss_mb"]]
    result["threads_end"] = training_points[-1]["threads"]
    (args.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    chart(loaders, training_points, args.out / "soak.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("loaders", "training")}))
    print(f"chart: {args.out / 'soak.png'}")
    return 0


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
