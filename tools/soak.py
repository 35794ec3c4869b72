#!/usr/bin/env python3
"""Soak: the image loader for many epochs, then training for many steps, watching resident
memory, open file descriptors and threads; a table, JSON and a PNG chart.

    python tools/soak.py --out soak-out [--epochs 30] [--steps 1500]

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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cliutil import positive_int, setup_logging  # noqa: E402


def reading() -> dict[str, float]:
    gc.collect()  # count what is kept, not garbage not yet collected
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    return {"t": time.monotonic(), "rss_mb": round(rss, 1),
            "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}


def soak_loader(shards: Path, epochs: int) -> list[dict[str, float]]:
    from pipeline import image_loader

    points = [reading()]
    with image_loader(shards, batch_size=32, device="auto") as loader:
        for epoch in range(epochs):
            for _ in loader:
                pass
            points.append({**reading(), "epoch": epoch + 1})
    return points


def soak_training(shards: Path, run: Path, steps: int) -> list[dict[str, float]]:
    import torch

    from pipeline.image import ImageConfig, ImageLoader
    from pipeline.shardlist import resolve
    from trainers.image_task import ImageClassification
    from trainers.loop import TrainConfig, Trainer
    from trainers.run import fit

    source, points = resolve(shards), [reading()]
    loader = ImageLoader(source, ImageConfig(batch_size=32, size=48, device="cpu"), 0, 1)
    task = ImageClassification(len(source.classes or {}) or 10, device=torch.device("cpu"))
    chunk = max(steps // 10, 1)
    for upto in range(chunk, steps + 1, chunk):  # resume in chunks: checkpoints, reloads
        cfg = TrainConfig(run_dir=run, steps=upto, checkpoint_every=chunk, log_every=chunk)
        fit(Trainer(task, loader, cfg, torch.device("cpu"), {"data": source.fingerprint()}))
        points.append({**reading(), "step": upto})
    loader.close()
    return points


def chart(loader: list[dict[str, Any]], training: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for row, (points, xkey, label) in enumerate(((loader, "epoch", "loader epoch"),
                                                 (training, "step", "training step"))):
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

    from pipeline.builtin import make_image_folder
    from pipeline.convert import ConvertConfig, convert

    shutil.rmtree(args.out, ignore_errors=True)
    src = make_image_folder(args.out / "images", per_class=max(args.images // 10, 1))
    convert(ConvertConfig(kind="imagefolder", src=str(src), out=args.out / "shards",
                          max_count=50, shuffle_seed=0))
    loader_points = soak_loader(args.out / "shards", args.epochs)
    training_points = soak_training(args.out / "shards", args.out / "run", args.steps)
    result = {"loader": loader_points, "training": training_points,
              "loader_rss_growth_mb_per_epoch": round(growth(loader_points, "rss_mb"), 2),
              "training_rss_growth_mb_per_chunk": round(growth(training_points, "rss_mb"), 2),
              "fds_end": loader_points[-1]["fds"], "threads_end": training_points[-1]["threads"]}
    (args.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    chart(loader_points, training_points, args.out / "soak.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("loader", "training")}))
    print(f"chart: {args.out / 'soak.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
