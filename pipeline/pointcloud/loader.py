"""The point-cloud loader: shards of `.npy` + `.cls` -> (DALI or streaming reader) -> label and
`.npy` header checks, per-sample augmentation parameters -> DALI graph (decode, normalize,
rotate and scale, sample or pad to num_points, jitter) -> voxel grid -> `PointBatch`.

    from shardflow import pointcloud_loader
    with pointcloud_loader("shards/pc", batch_size=32, voxels="occupancy") as loader:
        for batch in loader:
            ...  # batch.points (B, num_points, 3) float32; batch.voxels (B, 1, G, G, G)

Two background stages overlap with the consumer: the reader stage (read, check labels and
`.npy` headers, draw each sample's parameters: pointcloud/sample.py) and the decode stage (the
graph in pointcloud/graph.py; value checks and voxels in pointcloud/decode.py). Everything
random is drawn in numpy from (seed, epoch, key), so a resumed loader or a rebuilt graph gives
the same clouds; evaluation (train=False) keeps evenly spaced points and does not augment.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.errors import DataError, OnError
from shardflow.loading import mix, readers, settled, tuning
from shardflow.loading.batch import EncodedBatch
from shardflow.loading.graphstage import GraphLoader
from shardflow.loading.options import Device, check_names
from shardflow.loading.shardlist import Source
from shardflow.pointcloud.config import PointCloudConfig, split_augment
from shardflow.pointcloud.decode import CloudStage, DecodeStage
from shardflow.pointcloud.portable import PortableCloudStage
from shardflow.pointcloud.sample import SampleParams, check_npy, sample_params
from shardflow.samples.checks import OFFSET_EXT, check_label, check_offset
from shardflow.samples.scans import LABELS_EXT, NO_IGNORE, check_labels

log = logging.getLogger(__name__)
MEMBERS = ("npy",)  # what the loader reads: make_shards stores every cloud as .npy


def pointcloud_loader(source: str | Path | Sequence[str] | Source | mix.Mixture, *,
                      batch_size: int, train: bool = True, seed: int = 0,
                      device: Device = "auto", on_error: OnError = "raise",
                      rank: int | None = None, world_size: int | None = None,
                      local_world_size: int = 1, tuning_file: Path | None = None,
                      use_tuning: bool = True, **options: Any
                      ) -> PointCloudLoader | mix.MixedLoader:
    """A resumable loader of point-cloud batches (see `PointCloudConfig` for `options`).

    `source`: a folder with manifest.json, a glob, a brace pattern, a list of URLs, or any
    fsspec URL; a `Source` resolved already (resolve_source; e.g. a held-out part of one);
    or a mixture `[(source, weight), ...]` (pipeline/loading/mix.py).
    `rank`/`world_size` default to torch.distributed's when it is initialised;
    `local_world_size`: the ranks on this node (torchrun's LOCAL_WORLD_SIZE), which share its
    cores among their decode threads. Choices left automatic that a tuning file measured
    (decode, reader, threads, prefetch) come from it (pipeline/loading/tuning.py), else from
    the rules of loading/settled.py; `loader.settled` records which.
    """
    check_names("pointcloud_loader", options, PointCloudConfig)
    if mix.is_mixture(source) or "epoch_samples" in options:  # by weight; mix.py
        return mix.build_from(pointcloud_loader, mix.sources_of(source), {
            "batch_size": batch_size, "train": train, "seed": seed, "device": device,
            "on_error": on_error, "rank": rank, "world_size": world_size,
            "local_world_size": local_world_size, "tuning_file": tuning_file,
            "use_tuning": use_tuning, **options})
    asked = {"device": device, **options}
    resolved, tuned = tuning.source_and_options("pointcloud", source, asked, tuning_file,
                                                use_tuning)
    options, record = settled.settle(asked, tuned, tuning_file,
                                     settled.thread_rule(local_world_size))
    cfg = PointCloudConfig(batch_size=batch_size, train=train, seed=seed, on_error=on_error,
                           **options)
    rank, world_size = readers.distributed(rank, world_size)
    loader = PointCloudLoader(resolved, cfg, rank, world_size)
    loader.settled = record
    return loader


class PointCloudLoader(GraphLoader):
    """Batches of clouds on the target device. Build with `pointcloud_loader(...)`."""

    kind = "pointcloud"
    members = MEMBERS
    # A cloud far from the origin is stored relative to an offset kept beside it (make_shards;
    # samples/checks.cloud_members): read along, parsed here, returned as batch.offset.
    extras = (OFFSET_EXT,)

    def __init__(self, source: Source, cfg: PointCloudConfig, rank: int, world_size: int
                 ) -> None:
        self.cfg = cfg
        self._augment = cfg.augment_spec()
        if cfg.per_point_labels:  # a scene's labels member too (samples/scans.py)
            self.extras = (LABELS_EXT, OFFSET_EXT)
        self._scene_classes(source, cfg)
        super().__init__(source, cfg, rank, world_size)
        if cfg.per_point_labels:
            self.num_classes = cfg.num_classes or self._seg.get("num_classes")
            self._decoder.ignore_label = self.ignore_label

    def _scene_classes(self, source: Source, cfg: PointCloudConfig) -> None:
        """A scene loader's ignore label and class names: the options', else the manifest's
        `segmentation` (make_shards --layout kitti|scans), else none (NO_IGNORE)."""
        self._seg = source.segmentation or {}
        ignore = cfg.ignore_label if cfg.ignore_label is not None else \
            self._seg.get("ignore_label")
        self.ignore_label: int = NO_IGNORE if ignore is None else int(ignore)
        self.class_names: list[str] | None = self._seg.get("class_names")
        if cfg.per_point_labels and source.modality == "pointcloud" and not self._seg and \
                source.shards and source.classes:
            raise ValueError(f"{source.describe()}: these clouds have a label each (class "
                             "folders), not per point: per_point_labels is for scenes "
                             "converted with make_shards --layout kitti|scans")

    def _decode_stage(self) -> CloudStage:
        if self.backend == "portable":
            return PortableCloudStage(self.cfg, self.placement)
        return DecodeStage(self.cfg, self.placement)

    def describe(self) -> dict[str, Any]:
        """Where each op of augment runs: the graph's (its leading RotateZ, Scale, Jitter:
        the DALI graph, or the portable backend's numpy transform), then torch's."""
        graph, rest = split_augment(self.cfg.augment) if self.cfg.augment is not None \
            else ((), ())
        in_graph = f"the DALI graph ({self.decode})" if self.backend == "dali" else \
            "the portable backend's numpy transform"
        where = "torch in the decode stage" + (f", on cuda:{self.cuda_index}"
                                               if self.decode == "gpu" else ", on the CPU")
        return {"backend": self.backend, "reader": self.reader, "decode": self.decode,
                "augment": [{"op": repr(op), "runs": in_graph} for op in graph]
                + [{"op": repr(op), "runs": where} for op in rest]}

    # -- the reader stage ------------------------------------------------------------------

    def _check_one(self, enc: EncodedBatch, i: int, epoch: int) -> tuple[Any, SampleParams]:
        if self.cfg.per_point_labels:
            return self._check_scene(enc, i, epoch)
        if self.cfg.labels and enc.labels[i] is None:
            raise DataError("missing-field", "no .cls member (for clouds without labels, such "
                            "as unlabelled scans, pass labels=False)")
        label = check_label(enc.labels[i] or b"", self.num_classes) if self.cfg.labels \
            else None
        rows = self._check_cloud(enc, i)
        return label, sample_params(self._augment, rows, enc.keys[i], epoch)

    def _check_scene(self, enc: EncodedBatch, i: int, epoch: int
                     ) -> tuple[np.ndarray, SampleParams]:
        rows = self._check_cloud(enc, i)
        labels = check_labels(enc.extras[LABELS_EXT][i], rows, self.num_classes,
                              self.ignore_label)
        return labels, sample_params(self._augment, rows, enc.keys[i], epoch)

    def _check_cloud(self, enc: EncodedBatch, i: int) -> int:
        """Sample `i`'s cloud checked (made plain, relative to an offset where float32 would
        damage it) and its offset member parsed: the offset column holds the sum of both
        (float64), so that points + batch.offset are the file's coordinates whoever wrote
        the shard. The cloud's point count."""
        enc.data[i], rows, taken = check_npy(enc.data[i], self.cfg.max_points)
        offsets = enc.extras.setdefault(OFFSET_EXT, [None] * len(enc))  # drops with its sample
        own = None if offsets[i] is None else check_offset(offsets[i])
        if taken is not None:  # a sample with an offset member of its own too: both add
            own = taken if own is None else own + taken
        offsets[i] = own
        return rows
