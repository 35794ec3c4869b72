#!/usr/bin/env python3
"""The main job on the built-in data: generate the datasets, shard them, verify them, load and
train on them (images, text, point clouds, click logs, LiDAR scans labelled per point).

    shardflow demo --out demo-out

Everything is deterministic and local (no downloads). Prints one line per dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from shardflow.builtin import (
    make_ctr_dataset,
    make_image_folder,
    make_lidar_scans,
    make_photo_corpus,
    make_pointcloud_folder,
    make_text_corpus,
)
from shardflow.convert import ConvertConfig, convert
from shardflow.convert.sources import TextOptions
from shardflow.convert.tabular import TabularOptions
from shardflow.samples.scans import ScanOptions, with_learning_map
from shardflow.shards.verify import verify
from shardflow.tools.util import fail, setup_logging

MARKER = ".shardflow-demo"
# name -> (generator, make_shards kind, samples per shard)
DATASETS: dict[str, tuple[Callable[[Path], Path], str, int]] = {
    "images": (lambda p: make_image_folder(p, per_class=60), "imagefolder", 100),
    "photos": (lambda p: make_photo_corpus(p, count=100), "imagefolder", 25),
    "text": (lambda p: make_text_corpus(p, docs=400), "text", 100),
    "pointclouds": (lambda p: make_pointcloud_folder(p, per_class=40), "pointcloud", 60),
    # 80 blocks of 1000 rows, 8 a shard: 10 shards, the 10th held out for evaluation
    "ctr": (lambda p: make_ctr_dataset(p, rows=80_000), "tabular", 8),
    # ray-cast LiDAR scans in SemanticKITTI's layout, ~78,000 points each: 10 shards of 3
    "lidar": (lambda p: make_lidar_scans(p, frames=30), "pointcloud", 3),
}
# What a kind needs beyond the common options (make_shards.py tabular --preset criteo ...).
OPTIONS: dict[str, dict[str, Any]] = {
    "ctr": {"tabular": TabularOptions(preset="criteo", rows_per_block=1000)}}
# The CTR run passes when its held-out AUC is within this of the planted achievable AUC.
CTR_MARGIN = 0.03
# The LiDAR run passes when its held-out mIoU is this far above the majority class's.
LIDAR_MARGIN = 0.25


def prepare(out: Path) -> None:
    """Start from an empty folder; only a previous demo's folder may be replaced."""
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            fail(f"{out} is not empty and not a demo folder; choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).write_text("made by tools/demo.py; safe to delete\n")


def run_one(name: str, out: Path, workers: int) -> str:
    generate, kind, per_shard = DATASETS[name]
    start = time.perf_counter()
    raw = generate(out / "raw" / name)
    # Shuffled across shards, so that any shard (say, a held-out one) holds every class.
    options = OPTIONS.get(name, {})
    if name == "lidar":  # make_shards --layout kitti --learning-map RAW/semantic-demo.yaml
        options = {"scan": with_learning_map(ScanOptions("kitti"), raw / "semantic-demo.yaml")}
    cfg = ConvertConfig(kind=kind, src=str(raw), out=str(out / "shards" / name), shuffle_seed=0,
                        max_count=per_shard, workers=workers, text=TextOptions(), **options)
    manifest = convert(cfg)
    reports, _ = verify(str(cfg.out), workers=workers)
    problems = sum(len(r.problems) for r in reports)
    size = sum(s.bytes for s in manifest.shards) / 1e6
    classes = len(manifest.classes) if manifest.classes else "-"
    return (f"{name:<12} {manifest.modality:<10} {manifest.total_samples:>7} {classes:>7} "
            f"{len(manifest.shards):>6} {size:>8.1f} {len(manifest.skipped):>7} "
            f"{'ok' if problems == 0 else f'{problems} problems':>9} "
            f"{time.perf_counter() - start:>6.1f}s")


def load_images(shards: Path) -> None:
    """Two epochs of the image loader over the photo shards, as training would read them:
    the first says how soon data arrives, the second how fast it flows once warm."""
    from shardflow.image.loader import ImageLoader, image_loader

    with image_loader(shards, batch_size=25, device="auto") as loader:
        assert isinstance(loader, ImageLoader)  # one source, not a mixture
        start = time.perf_counter()
        batch = next(iter(loader))
        first = time.perf_counter() - start
        loader.set_epoch(1)
        start, seen = time.perf_counter(), 0
        for batch in loader:
            seen += len(batch)
        rate = seen / (time.perf_counter() - start)
    print(f"image loader ({loader.device}, {loader.backend} backend, {loader.reader} reader): "
          f"batches of {tuple(batch.image.shape)} {batch.image.dtype}; first batch after "
          f"{first:.2f} s; {rate:.0f} images/s over an epoch of {seen}")


def train_images(out: Path) -> None:
    """Half a minute of training on the built-in images (bf16 where the CPU has it): 87%
    held out at 300 steps, measured on one core."""
    from shardflow.tools import train

    train.main(["--task", "image", "--data", str(out / "shards" / "images"), "--out",
                str(out / "run"), "--steps", "300", "--batch-size", "32", "--size", "48",
                "--checkpoint-every", "200", "--quiet"])
    summary = json.loads((out / "run" / "summary.json").read_text())
    print(f"eval accuracy {summary['accuracy']:.1%} on held-out shards (chance: 10%); "
          f"{summary['samples_per_s']:.0f} samples/s; {summary['data_wait']:.0%} of the time "
          f"waiting for data; metrics in {out / 'run' / 'metrics.jsonl'}")


def train_text(out: Path) -> None:
    """A small GPT-style decoder on the built-in text, byte-level: half a minute."""
    from shardflow.text.tokenizer import byte_unigram_entropy
    from shardflow.tools import train

    run = out / "run-text"
    train.main(["--task", "text", "--objective", "clm", "--data", str(out / "shards" / "text"),
                "--out", str(run), "--steps", "300", "--batch-size", "16", "--seq-len", "64",
                "--quiet"])
    summary = json.loads((run / "summary.json").read_text())
    docs = (out / "raw" / "text").glob("*.txt")
    entropy = byte_unigram_entropy(p.read_text(encoding="utf-8") for p in docs)
    print(f"text (clm): held-out loss {summary['eval_loss']:.2f} nats/byte against the "
          f"corpus's unigram entropy {entropy:.2f}; {summary['samples_per_s']:.0f} rows of 64 "
          f"tokens/s; metrics in {run / 'metrics.jsonl'}")


def train_pointclouds(out: Path) -> None:
    """PointNet on the built-in primitives (6 shapes)."""
    from shardflow.tools import train

    run = out / "run-pointcloud"
    train.main(["--task", "pointcloud", "--model", "pointnet", "--data",
                str(out / "shards" / "pointclouds"), "--out", str(run), "--steps", "300",
                "--batch-size", "32", "--num-points", "256", "--quiet"])
    summary = json.loads((run / "summary.json").read_text())
    print(f"point clouds (pointnet): eval accuracy {summary['accuracy']:.1%} on held-out "
          f"shards (chance: 17%); {summary['samples_per_s']:.0f} clouds/s; metrics in "
          f"{run / 'metrics.jsonl'}")


def train_lidar(out: Path) -> bool:
    """The bird's-eye U-Net on the ray-cast scans (voxels of 0.5 m over 64 x 64 m): the
    held-out mIoU against the majority class's (every point called the commonest class of
    the training scans); True when above it by LIDAR_MARGIN."""
    from shardflow.tools import train

    run = out / "run-lidar"
    train.main(["--task", "pointcloud-seg", "--model", "bev", "--data",
                str(out / "shards" / "lidar"), "--out", str(run), "--steps", "80",
                "--batch-size", "2", "--voxel-size", "0.5", "--point-range", "-32", "-32",
                "-3.2", "32", "32", "2.8", "--lr", "3e-3", "--quiet"])
    summary = json.loads((run / "summary.json").read_text())
    majority = majority_miou(out / "shards" / "lidar")
    ok = summary["miou"] >= majority + LIDAR_MARGIN
    print(f"lidar (bev): held-out mIoU {summary['miou']:.1%} against {majority:.1%} for the "
          f"majority class, {'above' if ok else 'NOT above'} it by the margin of "
          f"{LIDAR_MARGIN:.0%}; {summary['samples_per_s']:.1f} frames/s; metrics in "
          f"{run / 'metrics.jsonl'}")
    return ok


def majority_miou(shards: Path) -> float:
    """mIoU of calling every point the commonest class: that class's IoU is its share of
    the labelled points, every other class's is 0 (over the classes that occur)."""
    seg = json.loads((shards / "manifest.json").read_text())["segmentation"]
    counts = {int(k): n for k, n in seg["label_counts"].items() if int(k) != seg["ignore_label"]}
    return max(counts.values()) / sum(counts.values()) / len(counts)


def train_ctr(out: Path) -> bool:
    """DLRM on the built-in click logs, one pass over them as CTR models train: the held-out
    AUC against the AUC of the true click probabilities (planted.json); True within
    CTR_MARGIN."""
    from shardflow.tools import train

    run = out / "run-ctr"
    train.main(["--task", "ctr", "--model", "dlrm", "--data", str(out / "shards" / "ctr"),
                "--out", str(run), "--steps", "250", "--batch-size", "256", "--num-buckets",
                "1024", "--embedding-dim", "8", "--lr", "1e-2", "--quiet"])
    summary = json.loads((run / "summary.json").read_text())
    planted = json.loads((out / "raw" / "ctr" / "planted.json").read_text())
    gap = planted["achievable_auc"] - summary["auc"]
    verdict = "within" if gap <= CTR_MARGIN else "NOT within"
    print(f"click logs (dlrm): held-out AUC {summary['auc']:.3f} against the planted "
          f"achievable {planted['achievable_auc']:.3f}, {verdict} the margin of {CTR_MARGIN}; "
          f"logloss {summary['logloss']:.3f} (the click rate alone: "
          f"{planted['prior_logloss']:.3f}); {summary['samples_per_s']:.0f} rows/s; metrics in "
          f"{run / 'metrics.jsonl'}")
    return gap <= CTR_MARGIN


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("demo-out"))
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    setup_logging(quiet=False)
    prepare(args.out)
    print(f"{'dataset':<12} {'modality':<10} {'samples':>7} {'classes':>7} {'shards':>6} "
          f"{'MB':>8} {'skipped':>7} {'verify':>9} {'time':>7}")
    lines = [run_one(name, args.out, args.workers) for name in DATASETS]
    for line in lines:
        print(line)
    print()
    load_images(args.out / "shards" / "photos")
    print()
    train_images(args.out)
    train_text(args.out)
    train_pointclouds(args.out)
    ctr_ok = train_ctr(args.out)
    lidar_ok = train_lidar(args.out)
    print(f"\nshards are in {args.out / 'shards'}; check any of them with\n"
          f"  shardflow verify {args.out / 'shards' / 'images'} --world-size 2")
    return 0 if ctr_ok and lidar_ok and all(line.split()[-2] == "ok" for line in lines) else 1


def entry(argv: list[str] | None = None) -> NoReturn:
    """The command: main, its errors as one line and an exit code (util.run_main)."""
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
