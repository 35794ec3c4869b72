"""Voxel grids from a batch of clouds, vectorised in torch (one scatter_add over the whole
batch, no per-point Python loop), on whatever device the points are on.

    points (B, N, 3) float -> cell of each point -> drop points outside the grid
      -> "occupancy" (B, 1, G, G, G): 1.0 where a cell holds a point, else 0.0
      -> "count"     (B, 1, G, G, G): points per cell (float32)
      -> "pillars"   (B, 4, G, G): one column per (x, y) cell, z up; see PILLAR_FEATURES

The grid is the cube [-extent, extent)^3 cut into G cells per side; cells are half-open
[low, high), so a point exactly on the upper face (+extent) and any point beyond the cube, or
with a NaN coordinate, is dropped: it is not clamped into a border cell, which would invent
surface there. Padded clouds (a point repeated to reach num_points) count repeats in "count"
and in the pillars' count channel.

Example::

    grid = voxelize(points, "occupancy", grid=24, extent=1.0)  # (B, 1, 24, 24, 24)
"""

from __future__ import annotations

import statistics
import time
from typing import Literal

import numpy as np
import torch

VoxelMode = Literal["occupancy", "count", "pillars"]
MODES = ("occupancy", "count", "pillars")
# Channels of a pillar grid, per (x, y) column: how many points fall in it, and the mean,
# lowest and highest z of those points, each as a height in [0, 1) across the grid's z range.
# An empty column is all zeros; its count of 0 tells it from points at the very bottom.
PILLAR_FEATURES = ("count", "z_mean", "z_min", "z_max")


def voxelize(points: torch.Tensor, mode: VoxelMode, *, grid: int, extent: float
             ) -> torch.Tensor:
    """The `mode` grid of each cloud in `points` (B, N, >=3; only x, y, z are used), float32,
    on the points' device. See the module docstring for shapes and what is dropped."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {', '.join(MODES)}")
    if points.dim() != 3 or points.shape[-1] < 3:
        raise ValueError(f"points of shape {tuple(points.shape)}: expected (B, N, >=3)")
    if grid < 1 or not extent > 0:
        raise ValueError(f"grid={grid}, extent={extent}: need grid >= 1 and extent > 0")
    if mode != "pillars" and not points.is_cuda and points.shape[0] * grid**3 < 2**31 - 1:
        return _cpu_grid(points, mode, grid, extent)
    if mode == "pillars":
        return _pillars(points, padded_cells(points, grid, extent), grid, extent)
    return _device_grid(points, mode, grid, extent)


def _device_grid(points: torch.Tensor, mode: VoxelMode, grid: int, extent: float
                 ) -> torch.Tensor:
    """Occupancy or count in torch, on the points' device (the CUDA path)."""
    cells = padded_cells(points, grid, extent)
    counts = _scatter_count(_flat(cells, grid + 2, 3), points.shape[0] * (grid + 2) ** 3)
    inner = counts.view(points.shape[0], 1, grid + 2, grid + 2, grid + 2)[
        :, :, 1:-1, 1:-1, 1:-1]  # the border cells collected everything outside the cube
    # Counts are whole numbers >= 0, so min(count, 1) is the occupancy: one pass, one copy.
    return inner.clamp(max=1) if mode == "occupancy" else inner.contiguous()


def _cpu_grid(points: torch.Tensor, mode: VoxelMode, grid: int, extent: float
              ) -> torch.Tensor:
    """Occupancy or count on the CPU, the same grid as the torch path below at 1.2-1.5x its
    speed (tools/bench_loader.py --modality pointcloud): numpy's int32 arithmetic on the
    interleaved x, y, z, and every point outside the cube sent to one spare cell past the
    end, instead of a padded grid that is cut down (and copied) afterwards."""
    batch, cells = points.shape[0], batch_cells(points, grid, extent)
    size = batch * grid**3  # the spare cell's index
    if mode == "occupancy":
        out = np.zeros(size + 1, np.float32)
        out[cells] = 1.0
        grid_of = torch.from_numpy(out)
    else:  # torch's index_add_ beat numpy's bincount and add.at here
        index = torch.from_numpy(cells).long()
        grid_of = torch.zeros(size + 1).index_add_(0, index, torch.ones(1).expand(len(index)))
    return grid_of[:-1].view(batch, 1, grid, grid, grid)


def batch_cells(points: torch.Tensor, grid: int, extent: float) -> np.ndarray:
    """Each point's cell as a row-major index over the whole batch, int32 (B * N,): cloud b's
    cells come after those of clouds 0..b-1; B * grid**3 for a point outside the cube
    (on its upper face, beyond it, NaN or infinite)."""
    batch = points.shape[0]
    c = points[..., :3].float().cpu().numpy() * np.float32(grid / (2 * extent))
    c += np.float32(grid / 2 + 1)  # the same float32 sums as padded_cells: the same cells
    np.floor(c, out=c)
    # Into [0, grid + 1] before the integer cast (NaN to 0: fmax ignores a NaN operand), so
    # that the cast is defined on every CPU; then -1 and grid are the outsiders.
    np.fmax(c, 0, out=c)
    np.fmin(c, grid + 1, out=c)
    ci = c.astype(np.int32)
    ci -= 1
    ok = ci.view(np.uint32) < grid  # -1 wraps to 2**32 - 1: one comparison per axis
    inside = ok[..., 0] & ok[..., 1] & ok[..., 2]
    flat = ci[..., 0] * grid
    flat += ci[..., 1]
    flat *= grid
    flat += ci[..., 2]
    flat += (np.arange(batch, dtype=np.int32) * grid**3)[:, None]
    np.putmask(flat, ~inside, batch * grid**3)
    return flat.ravel()


def padded_cells(points: torch.Tensor, grid: int, extent: float) -> torch.Tensor:
    """Each point's cell (B, N, 3) as whole floats in a grid padded by one cell per side:
    1..grid inside the cube, 0 or grid + 1 for anything outside it, NaN included. Binning
    the outsiders into a border that is cut away afterwards costs less than masking them
    out point by point (a boolean mask and a gather took two thirds of the time)."""
    cells = points[..., :3].float().mul(grid / (2 * extent)).add_(grid / 2 + 1)
    return cells.nan_to_num_(nan=0.0).clamp_(0, grid + 1).floor_()


def _flat(cells: torch.Tensor, side: int, dims: int, on_device: bool | None = None
          ) -> torch.Tensor:
    """Row-major index of each cell over the whole batch (B, N) int64: cloud b's cells come
    after those of clouds 0..b-1. On CUDA (`on_device`: the default there) by integer
    multiply-adds with Python numbers as kernel arguments: a weights tensor made from a list
    is a pageable host-to-device copy, which waits for the stream (a host sync in the decode
    thread, every batch). On the CPU a float matmul, 1.8x the integer multiply-add there:
    exact in float32 while side**dims < 2**24, else in float64."""
    batch = torch.arange(cells.shape[0], device=cells.device).unsqueeze(1) * side**dims
    if cells.is_cuda if on_device is None else on_device:
        within = cells[..., 0].long()
        for d in range(1, dims):
            within = within.mul_(side).add_(cells[..., d].long())
        return within.add_(batch)
    dtype = torch.float32 if side**dims < 2**24 else torch.float64
    weights = torch.tensor([side ** (dims - 1 - d) for d in range(dims)], dtype=dtype)
    return torch.matmul(cells[..., :dims].to(dtype), weights).long().add_(batch)


def _scatter_count(flat: torch.Tensor, size: int, weights: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """float32 (size,): how many entries of `flat` (or the sum of their `weights`) per index."""
    flat = flat.reshape(-1)
    values = torch.ones(1, device=flat.device).expand(flat.numel()) if weights is None \
        else weights.reshape(-1)
    return torch.zeros(size, device=flat.device).scatter_add_(0, flat, values)


def _pillars(points: torch.Tensor, cells: torch.Tensor, grid: int, extent: float
             ) -> torch.Tensor:
    """(B, 4, G, G) of PILLAR_FEATURES. A point outside the cube in z must not reach its
    column, so those are moved to the padded border in x before the columns are binned."""
    batch, side = points.shape[0], grid + 2
    outside_z = (cells[..., 2] == 0) | (cells[..., 2] == grid + 1)
    cells = cells.clone()
    cells[..., 0].masked_fill_(outside_z, 0)
    flat, size = _flat(cells, side, 2), batch * side * side
    height = (points[..., 2].float() + extent) / (2 * extent)
    count = _scatter_count(flat, size)
    mean = _scatter_count(flat, size, height) / count.clamp(min=1)
    # include_self=False: a column no point falls in keeps its initial 0.
    low = torch.zeros(size, device=points.device).scatter_reduce_(
        0, flat.reshape(-1), height.reshape(-1), "amin", include_self=False)
    high = torch.zeros(size, device=points.device).scatter_reduce_(
        0, flat.reshape(-1), height.reshape(-1), "amax", include_self=False)
    stacked = torch.stack([count, mean, low, high]).view(4, batch, side, side)
    return stacked[:, :, 1:-1, 1:-1].transpose(0, 1).contiguous()


def points_per_second(points: torch.Tensor, mode: VoxelMode, *, grid: int, extent: float,
                      repeats: int = 5) -> dict[str, float]:
    """Voxelize `points` `repeats` times on one core (torch's intra-op threads set to 1 for the
    measurement, then restored) after one warm-up; returns the median wall-clock rate and the
    median rate per CPU-second of this process, both in points per second."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        voxelize(points, mode, grid=grid, extent=extent)
        walls, cpus = [], []
        for _ in range(repeats):
            cpu, wall = time.process_time(), time.perf_counter()
            voxelize(points, mode, grid=grid, extent=extent)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    finally:
        torch.set_num_threads(threads)
    n = points.shape[0] * points.shape[1]
    return {"points_per_s": n / statistics.median(walls),
            "points_per_cpu_s": n / max(statistics.median(cpus), 1e-9)}
