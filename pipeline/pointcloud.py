"""The point-cloud loader: shards of `.npy` + `.cls` -> (DALI or streaming reader) -> label and
`.npy` header checks, per-sample augmentation parameters -> DALI graph (decode, normalize,
rotate and scale, sample or pad to num_points, jitter) -> voxel grid -> `PointBatch`.

    from pipeline import pointcloud_loader
    with pointcloud_loader("shards/pc", batch_size=32, voxels="occupancy") as loader:
        for batch in loader:
            ...  # batch.points (B, num_points, 3) float32; batch.voxels (B, 1, G, G, G)

Two background stages overlap with the consumer: the reader stage (read, check labels and
`.npy` headers, draw each sample's parameters: pointcloud_sample.py) and the decode stage (the
graph in pointcloud_graph.py; value checks and voxels in pointcloud_decode.py). Everything
random is drawn in numpy from (seed, epoch, key), so a resumed loader or a rebuilt graph gives
the same clouds; evaluation (train=False) keeps evenly spaced points and does not augment.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline import readers, voxelize
from pipeline.batch import EncodedBatch
from pipeline.checks import check_label
from pipeline.errors import DataError, OnError, SkipLog, handle
from pipeline.loader import Loader, Produced
from pipeline.pointcloud_decode import DecodeStage, Item
from pipeline.pointcloud_sample import SampleParams, check_npy, sample_params
from pipeline.readplan import EpochPlan
from pipeline.shardlist import Source, resolve

log = logging.getLogger(__name__)
Device = Literal["auto", "cpu", "gpu"]
ReaderKind = readers.ReaderKind
POINTCLOUD_EXTS = ("npy",)


@dataclass(frozen=True)
class PointCloudConfig:
    """Options of `pointcloud_loader`; every field is also a keyword argument of it.

    voxels: None, "occupancy", "count" or "pillars" (see pipeline/voxelize.py), e.g.
    `voxels="occupancy", grid=32` gives `batch.voxels` of shape (B, 1, 32, 32, 32).
    """

    batch_size: int
    train: bool = True
    seed: int = 0
    device: Device = "auto"
    on_error: OnError = "raise"
    num_points: int = 1024  # per cloud: sampled without repeats, or padded by repeating
    voxels: voxelize.VoxelMode | None = None
    grid: int = 24  # voxel cells per side
    extent: float = 1.0  # the grid spans [-extent, extent) per axis; points beyond are dropped
    normalize: bool = True  # box centre to the origin, the farthest point to radius 1
    rotate: float = 180.0  # training: degrees about z, uniform in [-rotate, rotate]
    scale: tuple[float, float] = (0.8, 1.2)  # training: isotropic factor, uniform in range
    jitter: float = 0.01  # training: std of the Gaussian noise added to every coordinate
    max_points: int = 2_000_000  # a cloud declaring more is refused from its header
    num_classes: int | None = None  # labels must be below it (default: the manifest's)
    threads: int = field(default_factory=readers.cores)
    prefetch: int = 2
    shuffle_buffer: int = 1024
    reader: ReaderKind = "auto"
    allow_pipe: bool = False
    timeout_s: float | None = 600.0  # no batch for this long: the loader is hung, raise

    def __post_init__(self) -> None:
        readers.common_checks(self)
        readers.positive(self, "num_points", "grid", "max_points", "threads")
        if self.voxels is not None and self.voxels not in voxelize.MODES:
            raise ValueError(f"voxels={self.voxels!r}: choose None or one of "
                             f"{', '.join(voxelize.MODES)}")
        if not (math.isfinite(self.extent) and self.extent > 0):
            raise ValueError(f"extent={self.extent}: a half-width > 0 (1.0 after normalize)")
        if not 0 <= self.rotate <= 180:
            raise ValueError(f"rotate={self.rotate}: degrees in [0, 180] (0: no rotation)")
        readers.interval(self, "scale", 0, float("inf"))
        if not (math.isfinite(self.jitter) and self.jitter >= 0):
            raise ValueError(f"jitter={self.jitter}: a standard deviation >= 0 (0: none)")
        if self.num_classes is not None and self.num_classes < 1:
            raise ValueError(f"num_classes={self.num_classes}: must be positive (or None)")


def pointcloud_loader(source: str | Path | Sequence[str], *, batch_size: int,
                      train: bool = True, seed: int = 0, device: Device = "auto",
                      on_error: OnError = "raise", rank: int | None = None,
                      world_size: int | None = None, **options: Any) -> PointCloudLoader:
    """A resumable loader of point-cloud batches (see `PointCloudConfig` for `options`).

    `source`: a folder with manifest.json, a glob, a brace pattern, a list of URLs, or any
    fsspec URL. `rank`/`world_size` default to torch.distributed's when it is initialised.
    """
    cfg = PointCloudConfig(batch_size=batch_size, train=train, seed=seed, device=device,
                           on_error=on_error, **options)
    rank, world_size = readers.distributed(rank, world_size)
    return PointCloudLoader(resolve(source, allow_pipe=cfg.allow_pipe), cfg, rank, world_size)


class PointCloudLoader(Loader):
    """Batches of clouds on the target device. Build with `pointcloud_loader(...)`."""

    kind = "pointcloud"

    def __init__(self, source: Source, cfg: PointCloudConfig, rank: int, world_size: int
                 ) -> None:
        self.cfg = cfg
        self.device, self.cuda_index = readers.resolve_device(cfg.device, self.kind)
        self._init_from_config(source, cfg, rank, world_size)
        classes = self.source.classes
        self.num_classes = cfg.num_classes or (len(classes) if classes else None)
        self._decoder = DecodeStage(cfg, self.device, self.cuda_index)

    # -- the reader stage ------------------------------------------------------------------

    def _prepared(self, plan: EpochPlan, state: dict[str, Any] | None,
                  stop: threading.Event) -> Iterator[Item]:
        for enc in readers.encoded(self.reader, plan, state, self.on_error, POINTCLOUD_EXTS):
            if stop.is_set():
                return
            labels, params = self._check_and_plan(enc, plan.epoch)
            yield enc, labels, params

    def _check_and_plan(self, enc: EncodedBatch, epoch: int
                        ) -> tuple[list[int], list[SampleParams]]:
        """Drop (or raise on) samples with a bad label or `.npy` header; the parameters of
        the rest, aligned with what is left in `enc`."""
        labels, params, skips = [], [], SkipLog()
        for i in reversed(range(len(enc))):
            try:
                label, param = self._check_one(enc, i, epoch)
            except DataError as err:
                handle(err.located(source=enc.urls[i], key=enc.keys[i]), self.on_error, skips)
                enc.drop(i)
                continue
            labels.append(label)
            params.append(param)
        enc.skips.extend(reversed(skips.entries))
        return labels[::-1], params[::-1]

    def _check_one(self, enc: EncodedBatch, i: int, epoch: int) -> tuple[int, SampleParams]:
        if enc.labels[i] is None:
            raise DataError("missing-field", "no .cls member")
        label = check_label(enc.labels[i] or b"", self.num_classes)
        enc.data[i], rows = check_npy(enc.data[i], self.cfg.max_points)
        return label, sample_params(self.cfg, rows, enc.keys[i], epoch)

    # -- the decode stage ------------------------------------------------------------------

    def _produce(self, plan: EpochPlan, reader_state: dict[str, Any] | None,
                 stop: threading.Event) -> Iterator[Produced]:
        return self._two_stages(lambda s: self._prepared(plan, reader_state, s),
                                self._decoder, stop)

    def close(self) -> None:
        super().close()
        self._decoder.close()
