"""The point-cloud loader's options: the shared loader options plus what clouds need."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardflow.loading.options import GraphOptions, interval, positive
from shardflow.pointcloud import voxelize


@dataclass(frozen=True)
class PointCloudConfig(GraphOptions):
    """Options of `pointcloud_loader`; every field is also a keyword argument of it.

    voxels: None, "occupancy", "count" or "pillars" (see pipeline/pointcloud/voxelize.py), e.g.
    `voxels="occupancy", grid=32` gives `batch.voxels` of shape (B, 1, 32, 32, 32).

    labels=False reads clouds without labels (make_shards stores scans of which none has
    labels so): every batch.label is None, never a label made up.

    per_point_labels=True reads scenes labelled per point (make_shards --layout kitti|scans)
    into ragged `ScanBatch`es (pipeline/pointcloud/scene.py): no normalization (metres stay
    metres), every point kept unless `frame_points`; the scene options below apply, and
    `voxel_size` adds sparse voxels with majority labels (segvoxels.py).
    """

    num_points: int = 1024  # per cloud: sampled without repeats, or padded by repeating
    voxels: voxelize.VoxelMode | None = None
    grid: int = 24  # voxel cells per side
    extent: float = 1.0  # the grid spans [-extent, extent) per axis; points beyond are dropped
    # box centre to the origin, the farthest point to radius 1 (None: yes for clouds with a
    # label each, no for scenes labelled per point)
    normalize: bool | None = None
    rotate: float = 180.0  # training: degrees about z, uniform in [-rotate, rotate]
    scale: tuple[float, float] = (0.8, 1.2)  # training: isotropic factor, uniform in range
    jitter: float = 0.01  # training: std of the Gaussian noise added to every coordinate
    max_points: int = 2_000_000  # a cloud declaring more is refused from its header
    # Training ops (shardflow.ops.points), in place of rotate, scale and jitter: a leading
    # RotateZ, Scale, Jitter run in the graph as those do; the rest in torch, before voxels.
    augment: Any = None
    labels: bool = True  # False: clouds without a .cls (unlabelled scans); batch.label None
    # Scenes labelled per point (per_point_labels=True) only:
    per_point_labels: bool = False
    frame_points: int | None = None  # training: at most this many points a frame, drawn
    voxel_size: float | tuple[float, float, float] | None = None  # metres: sparse voxels
    point_range: tuple[float, ...] = (-40.0, -40.0, -3.0, 40.0, 40.0, 3.0)  # the voxel box
    flip: bool = False  # training: mirror x and/or y, each with probability 1/2
    translate: float = 0.0  # training: std in metres of a shift in x and y (z: a quarter)
    crop_range: float | None = None  # training: keep points within this xy distance
    crop_box: tuple[float, float] | None = None  # training: an x, y window about a point
    ignore_label: int | None = None  # None: the manifest's (segmentation.ignore_label)

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "num_points", "grid", "max_points")
        self._check_scene()
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

    def _check_scene(self) -> None:
        """Scene options are for per_point_labels; normalize defaults to not for scenes."""
        if self.normalize is None:
            object.__setattr__(self, "normalize", not self.per_point_labels)
        scene = ("frame_points", "voxel_size", "crop_range", "crop_box", "ignore_label")
        if not self.per_point_labels:
            given = [n for n in scene if getattr(self, n) is not None] + \
                [n for n in ("flip", "translate") if getattr(self, n)]
            if given:
                raise ValueError(f"{', '.join(given)}: options of scenes labelled per point "
                                 "(per_point_labels=True)")
            return
        if not self.labels:
            raise ValueError("labels=False with per_point_labels: the one reads no label, the "
                             "other a label per point; unlabelled scans are read with "
                             "labels=False alone")
        if self.normalize:
            raise ValueError("normalize=True with per_point_labels: a scene keeps its metres")
        if self.voxels is not None or self.augment is not None:
            raise ValueError("voxels= and augment= are for clouds with a label each; scenes "
                             "take voxel_size= and the scene augmentations")
        if self.frame_points is not None:
            positive(self, "frame_points")
        if self.voxel_size is not None:
            size = self.voxel_size
            object.__setattr__(self, "voxel_size", tuple(float(v) for v in (
                (size,) * 3 if isinstance(size, (int, float)) else size)))
            self.voxel_grid()  # checks the sizes and the range
        for name in ("translate", "crop_range"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value}: metres >= 0")
        if self.crop_box is not None and not (len(self.crop_box) == 2 and all(
                math.isfinite(v) and v > 0 for v in self.crop_box)):
            raise ValueError(f"crop_box={self.crop_box}: (x width, y width) in metres, > 0")

    @property
    def scene(self) -> bool:
        """As AugmentSpec.scene: sample.py takes either."""
        return self.per_point_labels

    def voxel_grid(self) -> Any:
        """The scenes' voxel grid (segvoxels.VoxelGrid), or None without voxel_size."""
        from shardflow.pointcloud.segvoxels import VoxelGrid

        if self.voxel_size is None:
            return None
        return VoxelGrid(self.voxel_size, tuple(self.point_range))  # type: ignore[arg-type]

    def augment_spec(self) -> AugmentSpec:
        """The graph's augmentation: rotate, scale and jitter, or augment's leading ops."""
        if self.per_point_labels:
            return AugmentSpec(self.seed, self.train, self.num_points, self.rotate, self.scale,
                               self.jitter, True, self.frame_points, self.flip, self.translate,
                               self.crop_box is not None)
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
    from shardflow.ops import points

    ops_ = tuple(augment) if isinstance(augment, (list, tuple)) else (augment,)
    for op in ops_:
        if not isinstance(op, points.PointOp):
            raise ValueError(f"augment: {op!r} is not a shardflow.ops.points op (subclass "
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
    scene: bool = False  # a scene labelled per point: the fields below apply
    frame_points: int | None = None
    flip: bool = False
    translate: float = 0.0
    crop_box: bool = False  # a crop box's centre (a point of the frame) is drawn
