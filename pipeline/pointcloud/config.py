"""The point-cloud loader's options: the shared loader options plus what clouds need."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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
    # Training ops (pipeline.ops.points), in place of rotate, scale and jitter: a leading
    # RotateZ, Scale, Jitter run in the graph as those do; the rest in torch, before voxels.
    augment: Any = None

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
        if self.augment is not None:
            if not self.train:
                raise ValueError("augment is for training loaders (train=True); evaluation "
                                 "reads evenly spaced points, unaugmented")
            object.__setattr__(self, "augment", sum(split_augment(self.augment), ()))

    def augment_spec(self) -> AugmentSpec:
        """The graph's augmentation: rotate, scale and jitter, or augment's leading ops."""
        if self.augment is None:
            return AugmentSpec(self.seed, self.train, self.num_points, self.rotate, self.scale,
                               self.jitter)
        graph, _ = split_augment(self.augment)
        rotate = next((op.degrees for op in graph if hasattr(op, "degrees")), 0.0)
        scale = next((op.scale for op in graph if hasattr(op, "scale")), (1.0, 1.0))
        jitter = next((op.std for op in graph if hasattr(op, "std")), 0.0)
        return AugmentSpec(self.seed, self.train, self.num_points, rotate, scale, jitter)

    def torch_ops(self) -> tuple[Any, ...]:
        """augment's ops after the graph's: run in torch, in the decode stage."""
        return split_augment(self.augment)[1] if self.augment is not None else ()


def split_augment(augment: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(the leading ops the graph runs: RotateZ, Scale, Jitter, each once, Jitter last as the
    graph adds noise last; the rest); ValueError for what is not a point op."""
    from pipeline.ops import points

    ops_ = tuple(augment) if isinstance(augment, (list, tuple)) else (augment,)
    for op in ops_:
        if not isinstance(op, points.PointOp):
            raise ValueError(f"augment: {op!r} is not a pipeline.ops.points op (subclass "
                             "ops.points.PointOp with draw and torch)")
    lead: list[Any] = []
    for op in ops_:
        kinds = [type(o) for o in lead]
        if type(op) not in points.IN_GRAPH or type(op) in kinds or points.Jitter in kinds:
            break  # isotropic scale and a turn about z commute; noise comes after both
        lead.append(op)
    return tuple(lead), ops_[len(lead):]


@dataclass(frozen=True)
class AugmentSpec:
    """What drawing one cloud's parameters needs (sample.py): no more than that."""

    seed: int
    train: bool
    num_points: int
    rotate: float
    scale: tuple[float, float]
    jitter: float
