"""Point-cloud classification: a PointNet-style model on `batch.points` or a small 3D CNN
(VoxNet-style) on `batch.voxels`; cross-entropy, accuracy.

    task = PointCloudClassification(6, model="voxnet", grid=24)   # loader: voxels="occupancy"

Both are small enough to train in a few hundred steps on two CPU cores under bf16 autocast.
Neither uses batch normalization after pooling, so a batch of one cloud (the tail of an epoch
under on_error="skip") still trains.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardflow.trainers.classify import Classification

MODELS = ("pointnet", "voxnet")


class PointNet(nn.Module):
    """A shared per-point MLP (1x1 convolutions), max-pooled over points, then a classifier
    head: invariant to the order of the points, as a cloud's rows have no order."""

    def __init__(self, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _pointwise(3, width), _pointwise(width, 2 * width), _pointwise(2 * width, 4 * width))
        self.head = nn.Sequential(nn.Linear(4 * width, 2 * width), nn.ReLU(inplace=True),
                                  nn.Linear(2 * width, num_classes))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        x = self.features(points.transpose(1, 2))  # (B, N, 3) -> (B, 3, N) -> (B, C, N)
        return self.head(x.amax(dim=2))


def _pointwise(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv1d(cin, cout, 1, bias=False), nn.BatchNorm1d(cout),
                         nn.ReLU(inplace=True))


class VoxNet(nn.Module):
    """Three 3x3x3 convolution blocks (the first two halve the grid), global max pooling,
    a linear classifier; input (B, 1, G, G, G) occupancy or counts."""

    def __init__(self, num_classes: int, width: int = 8, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _block(in_channels, width), nn.MaxPool3d(2), _block(width, 2 * width),
            nn.MaxPool3d(2), _block(2 * width, 4 * width), nn.AdaptiveMaxPool3d(1))
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, voxels: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(voxels).flatten(1))


def _block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm3d(cout),
                         nn.ReLU(inplace=True))


class PointCloudClassification(Classification):
    """A classifier over `PointBatch(points, label, keys, voxels)`. "voxnet" needs a loader
    built with voxels="occupancy" or "count" and the same `grid`."""

    def __init__(self, num_classes: int, model: str = "pointnet",
                 device: torch.device | str = "cpu", grid: int = 24) -> None:
        if model not in MODELS:
            raise ValueError(f"model={model!r}: choose one of {', '.join(MODELS)} for point "
                             "clouds")
        if num_classes < 2 or grid < 4:
            raise ValueError(f"num_classes={num_classes}, grid={grid}: need at least 2 "
                             "classes and a grid of at least 4 cells (voxnet pools twice)")
        self.num_classes, self.model_name, self.grid = num_classes, model, grid
        self.device = torch.device(device)
        net = PointNet(num_classes) if model == "pointnet" else VoxNet(num_classes)
        self.model: nn.Module = net.to(self.device)

    def _inputs(self, batch: Any) -> torch.Tensor:
        if self.model_name == "pointnet":
            return batch.points
        voxels = batch.voxels
        expected = (1, self.grid, self.grid, self.grid)
        if voxels is None or tuple(voxels.shape[1:]) != expected:
            got = None if voxels is None else tuple(voxels.shape[1:])
            raise ValueError(f"voxnet needs batch.voxels of shape (B, *{expected}), got {got}; "
                             f"build the loader with voxels='occupancy' (or 'count') and "
                             f"grid={self.grid}")
        return voxels

    def describe(self) -> dict[str, Any]:
        grid = self.grid if self.model_name == "voxnet" else None
        return {"task": "pointcloud", "model": self.model_name,
                "num_classes": self.num_classes, "grid": grid}
