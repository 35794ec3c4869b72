"""The point-cloud loader benchmark: our loader (DALI decode + augment, voxels in the decode
stage) beside a plain Python loop doing the same work on the same shards, and the voxelizer's
points per second on one core against a reference of 30 million (a well-known C++ voxel grid).

    result, table = run(args)   # args: batch_size, repeats, threads, work (a folder);
                                # optional: clouds, points, num_points, grid, voxels, and
                                # source (your shards, instead of the built-in clouds)

The two loaders run alternately after a warm-up (bench.core.alternate) and every figure
is a median. Points per second count the points decoded: every point of every cloud read.
"""

from __future__ import annotations

import io
import shutil
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.loading.shardlist import resolve_source
from shardflow.pointcloud import voxelize
from shardflow.pointcloud.loader import (
    PointCloudConfig,
    SampleParams,
    pointcloud_loader,
    sample_params,
)
from shardflow.tools.bench.core import alternate, cpu_seconds, loader_figures

REFERENCE_POINTS_PER_S = 30e6  # per core: a well-known C++ voxel grid, as the issue quotes it


@dataclass(frozen=True)
class Corpus:
    """Shards of clouds, and what each contender is asked to produce."""

    shards: Path
    clouds: int
    points: int  # in all the clouds together, as stored
    batch_size: int
    threads: int
    num_points: int = 1024
    grid: int = 24
    voxels: voxelize.VoxelMode = "occupancy"

    def config(self) -> PointCloudConfig:
        return PointCloudConfig(batch_size=self.batch_size, device="cpu", threads=self.threads,
                                num_points=self.num_points, grid=self.grid,
                                voxels=self.voxels)


def build_corpus(work: Path, clouds: int, points: int, batch_size: int, threads: int,
                 **options: Any) -> Corpus:
    from shardflow.builtin import make_pointcloud_folder
    from shardflow.convert import ConvertConfig, convert

    per_class = max(clouds // 6, 1)
    folder = make_pointcloud_folder(work / "clouds", per_class=per_class, points=points)
    convert(ConvertConfig(kind="pointcloud", src=str(folder), out=str(work / "shards"),
                          max_count=max(clouds // 8, 1), workers=threads))
    clouds = per_class * 6
    return Corpus(work / "shards", clouds, clouds * points, batch_size, threads, **options)


def existing_corpus(shards: Path, batch_size: int, threads: int, **options: Any) -> Corpus:
    """The user's shards (a folder with manifest.json), counted with one untimed read."""
    c = Corpus(shards, 0, 0, batch_size, threads, **options)
    sizes = [len(cloud) for _, cloud in PlainLoop(c).clouds()]
    return Corpus(shards, len(sizes), sum(sizes), batch_size, threads, **options)


# -- the contenders ----------------------------------------------------------------------------

class Ours:
    def __init__(self, c: Corpus) -> None:
        self.loader = pointcloud_loader(
            c.shards, batch_size=c.batch_size, device="cpu", threads=c.threads,
            num_points=c.num_points, grid=c.grid, voxels=c.voxels)

    def epoch(self) -> int:
        return sum(len(batch) for batch in self.loader)

    def close(self) -> None:
        self.loader.close()


class PlainLoop:
    """What a user writes without a pipeline: read each tar with our safe tar reader, np.load,
    the same augmentation in numpy (the same per-key parameters), batch, the same voxelizer;
    one thread, nothing overlapped."""

    def __init__(self, c: Corpus) -> None:
        self.c, self.cfg, self.epochs = c, c.config(), 0
        self.urls = [s.url for s in resolve_source(c.shards).shards]

    def epoch(self) -> int:
        import torch

        done, batch = 0, []
        for key, cloud in self.clouds():
            params = sample_params(self.cfg.augment_spec(), len(cloud), key, self.epochs)
            batch.append(augment_numpy(cloud, params, bool(self.cfg.normalize)))
            if len(batch) == self.c.batch_size:
                done += self._finish(torch.from_numpy(np.stack(batch)))
                batch = []
        if batch:
            done += self._finish(torch.from_numpy(np.stack(batch)))
        self.epochs += 1
        return done

    def clouds(self) -> Iterator[tuple[str, np.ndarray]]:
        import fsspec

        from shardflow.shards.tarread import iter_samples

        for url in self.urls:
            with fsspec.open(url, "rb") as f:
                for sample in iter_samples(f, url):
                    data, label = sample.get("npy"), sample.get("cls")
                    if not isinstance(data, bytes) or not isinstance(label, bytes):
                        raise ValueError(f"{url}: sample {sample['__key__']} lacks .npy or .cls")
                    int(label)  # the label is read too, as the loader reads it
                    yield str(sample["__key__"]), np.load(io.BytesIO(data), allow_pickle=False)

    def _finish(self, points: Any) -> int:
        voxelize.voxelize(points, self.c.voxels, grid=self.c.grid, extent=self.cfg.extent)
        return len(points)

    def close(self) -> None:
        pass


def augment_numpy(cloud: np.ndarray, params: SampleParams, normalize: bool) -> np.ndarray:
    """What the loader's graph does to one cloud, in numpy: (num_points, 3) float32."""
    xyz = cloud[:, :3].astype(np.float32)
    turn = np.deg2rad(params.angle)
    matrix = params.scale * np.array([[np.cos(turn), -np.sin(turn), 0.0],
                                      [np.sin(turn), np.cos(turn), 0.0],
                                      [0.0, 0.0, 1.0]])
    shift = np.zeros(3)
    if normalize:
        centre = (xyz.max(0) + xyz.min(0)) * np.float32(0.5)
        radius = np.sqrt(((xyz - centre) ** 2).sum(1).max())
        matrix, shift = matrix / radius, -(matrix / radius) @ centre
    out = (xyz[params.index] @ matrix.T + shift).astype(np.float32)
    return out if params.noise is None else out + params.noise


# -- the run ---------------------------------------------------------------------------------

def run(args: Any) -> tuple[dict[str, Any], str]:
    """Build the corpus under `args.work` (or take `args.source`), alternate the two loaders,
    measure the voxelizer; return (figures as a JSON-able dict, the markdown table). A corpus
    built here is removed after; `args.source` is only read."""
    work = Path(args.work) / "pointcloud"
    shutil.rmtree(work, ignore_errors=True)
    options = {"num_points": getattr(args, "num_points", 1024), "grid": getattr(args, "grid", 24),
               "voxels": getattr(args, "voxels", "occupancy")}
    source = getattr(args, "source", None)
    c = existing_corpus(Path(source), args.batch_size, args.threads, **options) if source \
        else build_corpus(work, getattr(args, "clouds", 600), getattr(args, "points", 2048),
                          args.batch_size, args.threads, **options)
    runs: dict[str, Any] = {"shardflow": Ours(c), "plain loop": PlainLoop(c)}
    try:
        timings = alternate({name: r.epoch for name, r in runs.items()}, repeats=args.repeats,
                            cpu_clock=cpu_seconds, expect=c.clouds)
        sample = next(iter(runs["shardflow"].loader)).points
        figures = loader_figures(lambda: Ours(c).loader, getattr(args, "epochs", 4))
    finally:
        for r in runs.values():
            r.close()
        shutil.rmtree(work, ignore_errors=True)
    result = report(c, timings, args.repeats)
    result["voxelize"] = voxel_rate(c, sample)
    result["shardflow"] = figures
    return result, table(result)


def report(c: Corpus, timings: Any, repeats: int) -> dict[str, Any]:
    names = list(timings.seconds)
    return {
        "clouds": c.clouds, "points_per_cloud": round(c.points / c.clouds, 1),
        "num_points": c.num_points,
        "batch_size": c.batch_size, "threads": c.threads, "repeats": repeats,
        "voxels": c.voxels, "grid": c.grid,
        "clouds_per_s": {n: round(timings.rate(n, c.clouds), 1) for n in names},
        "clouds_read": timings.counts,  # by each timed epoch: the same work for both
        "points_per_s": {n: round(timings.rate(n, c.points)) for n in names},
        "cpu_s_per_cloud": {n: round(statistics.median(timings.cpu[n]) / c.clouds, 6)
                            for n in names},
        "ratio shardflow/plain loop": round(timings.ratio("shardflow", "plain loop"), 3),
    }


def voxel_rate(c: Corpus, points: Any) -> dict[str, Any]:
    """The voxelizer alone on one of our batches, on one core (points per CPU-second)."""
    rate = voxelize.points_per_second(points, c.voxels, grid=c.grid, extent=1.0, repeats=10)
    per_core = rate["points_per_cpu_s"]
    return {"mode": c.voxels, "grid": c.grid, "batch": list(points.shape[:2]),
            "points_per_s_per_core": round(per_core),
            "reference_points_per_s_per_core": REFERENCE_POINTS_PER_S,
            "ratio_to_reference": round(per_core / REFERENCE_POINTS_PER_S, 3)}


def table(r: dict[str, Any]) -> str:
    v = r["voxelize"]
    lines = [f"{r['clouds']} clouds of {r['points_per_cloud']:g} points (mean) -> "
             f"{r['num_points']} points + {r['voxels']} grid {r['grid']}^3, batch "
             f"{r['batch_size']}, {r['threads']} threads, median of {r['repeats']}", "",
             "| loader | clouds/s | points decoded/s | CPU-s/cloud |", "|---|---|---|---|"]
    lines += [f"| {n} | {r['clouds_per_s'][n]} | {r['points_per_s'][n]:,} | "
              f"{r['cpu_s_per_cloud'][n]} |" for n in r["clouds_per_s"]]
    lines += ["", f"shardflow / plain loop: {r['ratio shardflow/plain loop']}x", "",
              f"voxelization alone ({v['mode']}, grid {v['grid']}, batch {v['batch'][0]} x "
              f"{v['batch'][1]} points): {v['points_per_s_per_core']:,} points/s per core, "
              f"{v['ratio_to_reference']}x the reference "
              f"({v['reference_points_per_s_per_core']:,.0f} points/s per core)", "",
              f"shardflow: time to first batch {r['shardflow']['time_to_first_batch_s']} s; "
              f"overlap {r['shardflow']['overlap']} (1.0 = perfect); RSS after each epoch "
              f"(MB) {r['shardflow']['rss_mb_after_each_epoch']}, peak "
              f"{r['shardflow']['peak_rss_mb']} MB"]
    return "\n".join(lines)
