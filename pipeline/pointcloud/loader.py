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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import DataError, OnError
from pipeline.loading import readers
from pipeline.loading.batch import EncodedBatch
from pipeline.loading.graphstage import GraphLoader
from pipeline.loading.options import Device
from pipeline.loading.shardlist import Source, resolve_source
from pipeline.pointcloud.config import PointCloudConfig
from pipeline.pointcloud.decode import DecodeStage
from pipeline.pointcloud.sample import SampleParams, check_npy, sample_params
from pipeline.samples.checks import check_label

log = logging.getLogger(__name__)
MEMBERS = ("npy",)  # what the loader reads: make_shards stores every cloud as .npy


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
    return PointCloudLoader(resolve_source(source, allow_pipe=cfg.allow_pipe), cfg, rank,
                            world_size)


class PointCloudLoader(GraphLoader):
    """Batches of clouds on the target device. Build with `pointcloud_loader(...)`."""

    kind = "pointcloud"
    members = MEMBERS

    def __init__(self, source: Source, cfg: PointCloudConfig, rank: int, world_size: int
                 ) -> None:
        self.cfg = cfg
        self._augment = cfg.augment_spec()
        super().__init__(source, cfg, rank, world_size)

    def _decode_stage(self) -> DecodeStage:
        return DecodeStage(self.cfg, self.device, self.cuda_index)

    # -- the reader stage ------------------------------------------------------------------

    def _check_one(self, enc: EncodedBatch, i: int, epoch: int) -> tuple[int, SampleParams]:
        if enc.labels[i] is None:
            raise DataError("missing-field", "no .cls member")
        label = check_label(enc.labels[i] or b"", self.num_classes)
        enc.data[i], rows = check_npy(enc.data[i], self.cfg.max_points)
        return label, sample_params(self._augment, rows, enc.keys[i], epoch)
