"""The point-cloud loader's options: the shared loader options plus what clouds need."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.loading.options import GraphOptions, interval, positive
from pipeline.pointcloud import voxelize


@dataclass(frozen=True)
class PointCloudConfig(GraphOptions):
    """Options of `pointcloud_loader`; every field is also a keyword argument of it.

    voxels: None, "occupancy", "count" or "pillars" (see pipeline/pointcloud/voxelize.py), e.g.
    `voxels="occupancy", grid=32` gives `batch.voxels` of shape (B, 1, 32, 32, 32).
    """

    num_points: int = 1024  # per cloud: sampled without repeats, or padded by repeating
    voxels: voxelize.VoxelMode | None = None
    grid: int = 24  # voxel cells per side
    extent: float = 1.0  # the grid spans [-extent, extent) per axis; points beyond are dropped
    normalize: bool = True  # box centre to the origin, the farthest point to radius 1
    rotate: float = 180.0  # training: degrees about z, uniform in [-rotate, rotate]
    scale: tuple[float, float] = (0.8, 1.2)  # training: isotropic factor, uniform in range
    jitter: float = 0.01  # training: std of the Gaussian noise added to every coordinate
    max_points: int = 2_000_000  # a cloud declaring more is refused from its header

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "num_points", "grid", "max_points")
        if self.voxels is not None and self.voxels not in voxelize.MODES:
            raise ValueError(f"voxels={self.voxels!r}: choose None or one of "
                             f"{', '.join(voxelize.MODES)}")
        if not (math.isfinite(self.extent) and self.extent > 0):
            raise ValueError(f"extent={self.extent}: a half-width > 0 (1.0 after normalize)")
        if not 0 <= self.rotate <= 180:
            raise ValueError(f"rotate={self.rotate}: degrees in [0, 180] (0: no rotation)")
        interval(self, "scale", 0, float("inf"))
        if not (math.isfinite(self.jitter) and self.jitter >= 0):
            raise ValueError(f"jitter={self.jitter}: a standard deviation >= 0 (0: none)")

    def augment_spec(self) -> AugmentSpec:
        return AugmentSpec(self.seed, self.train, self.num_points, self.rotate, self.scale,
                           self.jitter)


@dataclass(frozen=True)
class AugmentSpec:
    """What drawing one cloud's parameters needs (sample.py): no more than that."""

    seed: int
    train: bool
    num_points: int
    rotate: float
    scale: tuple[float, float]
    jitter: float
