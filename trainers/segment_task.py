"""LiDAR semantic segmentation (`--task pointcloud-seg`): a class for every point of ragged
scenes, `ScanBatch` from `pointcloud_loader(..., per_point_labels=True)`.

    ScanBatch: points (P, 3), offsets (B + 1,), labels (P,) [, voxel_coords (V, 4), point_voxel]
      pointnet: PointNetSeg(points, offsets) ----------------------------------> (P, K)
      bev:      BevUNet(voxel_coords, voxel_counts) -> (V, K) -> [point_voxel] -> (P, K)
      forward:  cross-entropy over the labelled points that have a prediction
      evaluate: SegTotals (segment_metrics.py) -> accuracy, miou, iou_<class>

    task = PointSegmentation(20, model="bev", ignore_label=0, voxel_size=0.4,
                             point_range=(-40, -40, -3, 40, 40, 3))   # 200 x 200 x 15 cells

- Classes: the model has `num_classes` logits, labels 0..num_classes-1. When `ignore_label`
  is one of them (SemanticKITTI's 0, "unlabeled"), its logit is never a target and is
  masked out of the predictions: the network spends one unused output rather than the
  labels being shifted. An ignore_label outside the range (255) costs nothing.
- The bev model predicts per voxel and projects back: a point takes its voxel's logits. A
  point outside the grid (point_voxel -1) has no prediction: it is not in the loss, and the
  metrics count it wrong (segment_metrics.py), so `point_range` bounds what bev can get right.
- `describe()` holds the model, the classes and the grid (voxel size, range, cells): a
  checkpoint made on another grid is refused on resume rather than loaded into convolutions
  that would mean other heights.
- The loss is a float32 sum over the points divided by their count on the device: no host
  sync, and 0 (not NaN) for a batch without a labelled point. The training step logs no
  accuracy (StepOutput.logs): a float there would be a host sync every step; `evaluate`
  measures it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from shardflow.trainers.segment_metrics import SegTotals, point_totals
from shardflow.trainers.segment_models import BevUNet, PointNetSeg
from shardflow.trainers.task import StepOutput

__all__ = ["BevUNet", "PointNetSeg", "PointSegmentation", "SegTotals", "grid_cells"]

MODELS = ("pointnet", "bev")
DEFAULT_VOXEL_SIZE = 0.4  # metres, bev
# The point-cloud loader's default box, in the sensor's frame (KITTI's Velodyne sits 1.73 m
# above the ground): 200 x 200 x 15 cells of 0.4 m
DEFAULT_RANGE = (-40.0, -40.0, -3.0, 40.0, 40.0, 3.0)
DEFAULT_FRAME_POINTS = 20000  # pointnet's training points per frame


class PointSegmentation:
    """The Task for per-point labels: model "pointnet" (points) or "bev" (the loader's voxel
    grid, which needs the same `voxel_size` and `point_range` as the loader). `class_names`:
    one per class, for the metrics' keys (iou_car...); None: iou_0, iou_1..."""

    def __init__(self, num_classes: int, model: str = "pointnet", ignore_label: int = 0,
                 device: torch.device | str = "cpu", class_names: Sequence[str] | None = None,
                 voxel_size: float | Sequence[float] | None = None,
                 point_range: Sequence[float] | None = None, width: int = 32) -> None:
        if model not in MODELS:
            raise ValueError(f"model={model!r}: choose one of {', '.join(MODELS)} for "
                             "point-cloud segmentation")
        if num_classes < 2 or (class_names is not None and len(class_names) != num_classes):
            raise ValueError(f"num_classes={num_classes}, {class_names=}: need at least 2 "
                             "classes, and one name per class when names are given")
        self.num_classes, self.model_name, self.ignore_label = num_classes, model, ignore_label
        self.class_names = list(class_names) if class_names is not None else None
        self.device = torch.device(device)
        self.voxel_size: tuple[float, float, float] | None = None
        self.grid: tuple[int, int, int] | None = None
        box = DEFAULT_RANGE if point_range is None else _box(point_range)
        # pointnet: the range the loader was given, if any (the box its points come from)
        self.point_range = box if model == "bev" or point_range is not None else None
        if model == "bev":
            self.voxel_size = _three(DEFAULT_VOXEL_SIZE if voxel_size is None else voxel_size)
            self.grid = grid_cells(box, self.voxel_size)
            net: torch.nn.Module = BevUNet(num_classes, self.grid[2], width)
        else:
            net = PointNetSeg(num_classes, width)
        self.model: torch.nn.Module = net.to(self.device)

    def _logits(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each point's logits (P, K) in float32, and which points have them (None: all)."""
        if self.model_name == "pointnet":
            return self.model(batch.points, batch.offsets).float(), None
        self._check_grid(batch)
        voxel_logits = self.model(batch.voxel_coords, batch.voxel_counts,
                                  len(batch.offsets) - 1, batch.grid).float()
        inside = batch.point_voxel >= 0
        return voxel_logits[batch.point_voxel.clamp(min=0)], inside

    def _check_grid(self, batch: Any) -> None:
        if batch.voxel_coords is None:
            raise ValueError("model 'bev' needs the loader's voxel grid (batch.voxel_coords "
                             "is None): build the loader with voxel_size="
                             f"{self.voxel_size} and point_range={self.point_range}")
        if tuple(batch.grid) != self.grid:
            raise ValueError(f"a batch on a grid of {tuple(batch.grid)} cells for a model "
                             f"built for {self.grid} (voxel_size={self.voxel_size}, "
                             f"point_range={self.point_range}): give the loader and the "
                             "task the same voxel_size and point_range")

    def _loss_sum(self, logits: torch.Tensor, labels: torch.Tensor,
                  inside: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed cross-entropy and the number of points it covers (device tensors)."""
        if inside is not None:
            labels = labels.masked_fill(~inside, self.ignore_label)
        loss = F.cross_entropy(logits, labels, ignore_index=self.ignore_label, reduction="sum")
        return loss, (labels != self.ignore_label).sum()

    def forward(self, batch: Any) -> StepOutput:
        logits, inside = self._logits(batch)
        loss, points = self._loss_sum(logits, batch.labels, inside)
        return StepOutput(loss / points.clamp(min=1))

    def new_totals(self) -> SegTotals:
        k = self.num_classes
        return SegTotals(intersection=[0] * k, union=[0] * k, ignore_label=self.ignore_label,
                         class_names=self.class_names)

    def evaluate(self, batch: Any) -> SegTotals:
        labels = batch.labels
        wrong = labels[(labels != self.ignore_label)
                       & ((labels < 0) | (labels >= self.num_classes))]
        if len(wrong):  # a sync; evaluation is not the hot path
            raise ValueError(f"label {int(wrong[0])} in a model of {self.num_classes} classes "
                             f"(ignore_label {self.ignore_label}): pass --num-classes "
                             "above the largest label, or fix the shards' manifest")
        logits, inside = self._logits(batch)
        loss, points = self._loss_sum(logits, labels, inside)
        totals = point_totals(logits, labels, inside, self.ignore_label, self.class_names)
        # .item() waits for the device; evaluation is not the hot path
        totals.loss_sum, totals.loss_points = float(loss.item()), int(points.item())
        return totals

    def describe(self) -> dict[str, Any]:
        return {"task": "pointcloud-seg", "model": self.model_name,
                "num_classes": self.num_classes, "ignore_label": self.ignore_label,
                "voxel_size": None if self.voxel_size is None else list(self.voxel_size),
                "point_range": None if self.point_range is None else list(self.point_range),
                "grid": None if self.grid is None else list(self.grid)}


def _three(size: float | Sequence[float]) -> tuple[float, float, float]:
    sizes = [float(size)] * 3 if isinstance(size, (int, float)) else [float(s) for s in size]
    if len(sizes) != 3 or not all(math.isfinite(s) and s > 0 for s in sizes):
        raise ValueError(f"voxel_size={size}: metres > 0, one for every axis or (x, y, z)")
    return sizes[0], sizes[1], sizes[2]


def grid_cells(point_range: Sequence[float], voxel_size: Sequence[float]
               ) -> tuple[int, int, int]:
    """Cells per axis (X, Y, Z) of the box `point_range` (xmin, ymin, zmin, xmax, ymax, zmax)
    cut into voxels of `voxel_size` (x, y, z): the loader's own rule (segvoxels.VoxelGrid)."""
    from shardflow.pointcloud.segvoxels import VoxelGrid

    size = (float(voxel_size[0]), float(voxel_size[1]), float(voxel_size[2]))
    return VoxelGrid(size, _box(point_range)).dims  # type: ignore[arg-type]


def _box(point_range: Sequence[float]) -> tuple[float, ...]:
    box = tuple(float(v) for v in point_range)
    if len(box) != 6 or not all(math.isfinite(v) for v in box) or \
            not all(box[i + 3] > box[i] for i in range(3)):
        raise ValueError(f"point_range={tuple(point_range)}: (xmin, ymin, zmin, xmax, ymax, "
                         "zmax) in metres, each max above its min")
    return box
