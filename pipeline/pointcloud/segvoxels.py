"""Sparse voxels of scenes labelled per point: which voxels are occupied, each voxel's label
(the majority of its points'), and each point's voxel, so that per-voxel predictions project
back to the points. Vectorised in torch over the whole batch, on the points' device.

    points (P, 3), frame of each point (P,), labels (P,)
      -> cell = floor((p - low) / size) per axis; a point outside [low, high) -> voxel -1
      -> one id per (frame, ix, iy, iz) -> torch.unique: occupied voxels (sorted by frame,
         then x, y, z), each point's voxel row, points per voxel
      -> (voxel, label) pairs of the labelled points -> counted -> per voxel the label with
         the most points (a tie goes to the smaller label); a voxel with no labelled point
         gets the ignore label

Example::

    grid = VoxelGrid((0.4, 0.4, 0.4), (-40, -40, -3, 40, 40, 3))   # 200 x 200 x 15 cells
    rows = voxel_rows(points, frame, labels, grid, ignore_label=0)
    rows.point_voxel[i]   # point i's row in rows.coords (-1: outside the grid)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VoxelGrid:
    """Cells of `size` metres (x, y, z) from the corner (xmin, ymin, zmin) of the box
    `point_range` (xmin, ymin, zmin, xmax, ymax, zmax); `dims` cells per axis, as many as
    cover the box: where a side is not a whole number of cells, the last cell reaches past
    the box's max (by less than a cell), and points there have a voxel too."""

    size: tuple[float, float, float]
    point_range: tuple[float, float, float, float, float, float]

    def __post_init__(self) -> None:
        if len(self.size) != 3 or not all(math.isfinite(s) and s > 0 for s in self.size):
            raise ValueError(f"voxel_size={self.size}: three sizes > 0 in metres")
        low, high = self.point_range[:3], self.point_range[3:]
        pairs = zip(low, high, strict=True) if len(self.point_range) == 6 else iter(())
        if len(self.point_range) != 6 or not all(
                math.isfinite(a) and math.isfinite(b) and a < b for a, b in pairs):
            raise ValueError(f"point_range={self.point_range}: (xmin, ymin, zmin, xmax, ymax, "
                             "zmax), finite, each min below its max")
        if math.prod(self.dims) > 2**40:
            raise ValueError(f"{self.dims} cells: too many; use larger voxels")

    @property
    def dims(self) -> tuple[int, int, int]:
        low, high = self.point_range[:3], self.point_range[3:]
        # 1e-9: a side of 80 m in cells of 0.4 m is 200 cells, not 201 from 200.00000000000003
        return tuple(max(1, math.ceil((b - a) / s - 1e-9))  # type: ignore[return-value]
                     for a, b, s in zip(low, high, self.size, strict=True))


@dataclass
class VoxelRows:
    """coords int64 (V, 4) of (frame, ix, iy, iz); labels int64 (V,); counts int64 (V,)
    points per voxel; point_voxel int64 (P,) each point's row, -1 outside the grid."""

    coords: torch.Tensor
    labels: torch.Tensor
    counts: torch.Tensor
    point_voxel: torch.Tensor


def voxel_rows(points: torch.Tensor, frame: torch.Tensor, labels: torch.Tensor,
               grid: VoxelGrid, ignore_label: int) -> VoxelRows:
    """The occupied voxels of a batch of scenes (see the module docstring)."""
    dims = grid.dims
    cells, inside = _cells(points, grid)
    ids = ((frame[inside] * dims[0] + cells[:, 0]) * dims[1] + cells[:, 1]) * dims[2] \
        + cells[:, 2]
    unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    point_voxel = torch.full((len(points),), -1, dtype=torch.int64, device=points.device)
    point_voxel[inside] = inverse
    coords = torch.stack(_unravel(unique, dims), dim=1)
    voxel_labels = majority(inverse, labels[inside], len(unique), ignore_label)
    return VoxelRows(coords, voxel_labels, counts, point_voxel)


def _cells(points: torch.Tensor, grid: VoxelGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 cells of the points inside the grid (Q, 3), the inside mask (P,)). A NaN
    coordinate is outside: every comparison with it is false."""
    low = torch.tensor(grid.point_range[:3], dtype=torch.float64, device=points.device)
    size = torch.tensor(grid.size, dtype=torch.float64, device=points.device)
    dims = torch.tensor(grid.dims, dtype=torch.float64, device=points.device)
    scaled = torch.floor((points[:, :3].double() - low) / size)  # float64: exact cells
    inside = ((scaled >= 0) & (scaled < dims)).all(dim=1)
    return scaled[inside].long(), inside


def _unravel(ids: torch.Tensor, dims: tuple[int, int, int]) -> list[torch.Tensor]:
    z = ids % dims[2]
    rest = ids // dims[2]
    y = rest % dims[1]
    rest = rest // dims[1]
    return [rest // dims[0], rest % dims[0], y, z]


def majority(voxel: torch.Tensor, labels: torch.Tensor, voxels: int, ignore_label: int
             ) -> torch.Tensor:
    """Per voxel the label most of its labelled points have (ties: the smaller label), the
    ignore label where none is labelled. `voxel` (Q,) each point's voxel in [0, voxels)."""
    out = torch.full((voxels,), ignore_label, dtype=torch.int64, device=labels.device)
    labelled = labels != ignore_label
    voxel, labels = voxel[labelled], labels[labelled].long()
    if not len(labels):
        return out
    span = int(labels.max()) + 1  # a host read: one per batch
    pairs, counts = torch.unique(voxel * span + labels, return_counts=True)
    owner, label = pairs // span, pairs % span
    # Order by voxel, then most points (pairs come sorted by label within a voxel, and the
    # sorts are stable, so a tie keeps the smaller label first): the first of each wins.
    order = torch.sort(-counts, stable=True).indices
    order = order[torch.sort(owner[order], stable=True).indices]
    owner, label = owner[order], label[order]
    first = torch.ones_like(owner, dtype=torch.bool)
    first[1:] = owner[1:] != owner[:-1]
    out[owner[first]] = label[first]
    return out
