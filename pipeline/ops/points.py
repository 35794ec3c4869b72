"""Point-cloud ops: the op protocol over batches of clouds, float32 (N, P, C), xyz first.

Each op draws its parameter for one cloud from the cloud's generator (seed, epoch, key:
ops.sample_rngs) and applies a batch's parameters in one batched torch pass, on the CPU or
on the device. `pointcloud_loader(..., augment=[...])` runs a leading RotateZ, Scale and
Jitter in its graph (the DALI graph, or the portable backend's numpy transform: the
loader's own augmentation, with its draws), and every op after them here, in torch, before
the voxels are binned:

    pointcloud_loader(src, batch_size=32, augment=[ops.points.RotateZ(180),
                      ops.points.Scale((0.8, 1.2)), ops.points.Jitter(0.01),
                      ops.points.Dropout(0.875)])
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor  # in the ops, `torch` is also a method

from shardflow.ops.base import on_device


class PointOp:
    """One augmentation of clouds: `draw(rng)` per cloud, `torch(points, params)` batched
    over float32 (N, P, C) whose first three channels are x, y, z."""

    def draw(self, rng: random.Random) -> Any:
        raise NotImplementedError

    def torch(self, points: Tensor, params: Sequence[Any]) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def apply(ops: Sequence[PointOp], points: Tensor, rngs: Sequence[random.Random]) -> Tensor:
    """Each op in turn over the batch, its parameters drawn from each cloud's generator."""
    if len(rngs) != len(points):
        raise ValueError(f"{len(rngs)} generators for a batch of {len(points)} clouds")
    if points.dim() != 3 or points.shape[-1] < 3 or not points.is_floating_point():
        raise ValueError(f"point ops take float (N, P, C >= 3) clouds, not {points.dtype} "
                         f"{tuple(points.shape)}")
    for op in ops:
        points = op.torch(points, [op.draw(rng) for rng in rngs])
    return points


def _xyz(points: Tensor, xyz: Tensor) -> Tensor:
    """`points` with its first three channels replaced by `xyz`."""
    if points.shape[-1] == 3:
        return xyz
    return torch.cat([xyz, points[..., 3:]], dim=-1)


class RotateZ(PointOp):
    """A turn about z by an angle uniform in [-degrees, degrees] (the loader's `rotate`)."""

    def __init__(self, degrees: float = 180.0) -> None:
        if not 0 <= degrees <= 180:
            raise ValueError(f"RotateZ degrees={degrees}: in [0, 180]")
        self.degrees = degrees

    def draw(self, rng: random.Random) -> float:
        return rng.uniform(-self.degrees, self.degrees)

    def torch(self, points: Tensor, params: Sequence[Any]) -> Tensor:
        cos_sin = [(math.cos(math.radians(a)), math.sin(math.radians(a))) for a in params]
        rows = [[[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]] for c, s in cos_sin]
        rotation = on_device(rows, points.device, torch.float32).view(-1, 3, 3)
        return _xyz(points, points[..., :3] @ rotation.transpose(1, 2))


class Scale(PointOp):
    """An isotropic factor uniform in (low, high) (the loader's `scale`)."""

    def __init__(self, scale: tuple[float, float] = (0.8, 1.2)) -> None:
        if not 0 < scale[0] <= scale[1]:
            raise ValueError(f"Scale scale={scale}: need 0 < low <= high")
        self.scale = tuple(scale)

    def draw(self, rng: random.Random) -> float:
        return rng.uniform(*self.scale)

    def torch(self, points: Tensor, params: Sequence[Any]) -> Tensor:
        factors = on_device(list(params), points.device, torch.float32).view(-1, 1, 1)
        return _xyz(points, points[..., :3] * factors)


class Jitter(PointOp):
    """Gaussian noise of standard deviation `std` on every coordinate (the loader's
    `jitter`), each cloud's from a generator seeded by its draw."""

    def __init__(self, std: float = 0.01) -> None:
        if not std >= 0:
            raise ValueError(f"Jitter std={std}: a standard deviation >= 0")
        self.std = std

    def draw(self, rng: random.Random) -> int:
        return rng.getrandbits(63)

    def torch(self, points: Tensor, params: Sequence[Any]) -> Tensor:
        n, p = points.shape[:2]
        noise = torch.empty((n, p, 3), dtype=torch.float32)
        for i, seed in enumerate(params):  # host draws: the same noise on any device
            noise[i].normal_(0.0, self.std, generator=torch.Generator().manual_seed(seed))
        return _xyz(points, points[..., :3] + on_device(noise, points.device))


class Dropout(PointOp):
    """PointNet++'s random input dropout: a ratio uniform in [0, max_ratio] per cloud, each
    point dropped with it and replaced by the cloud's first point (the shape is kept)."""

    def __init__(self, max_ratio: float = 0.875) -> None:
        if not 0 <= max_ratio < 1:
            raise ValueError(f"Dropout max_ratio={max_ratio}: in [0, 1)")
        self.max_ratio = max_ratio

    def draw(self, rng: random.Random) -> tuple[float, int]:
        return rng.uniform(0.0, self.max_ratio), rng.getrandbits(63)

    def torch(self, points: Tensor, params: Sequence[Any]) -> Tensor:
        n, p = points.shape[:2]
        dropped = torch.zeros((n, p), dtype=torch.bool)
        for i, (ratio, seed) in enumerate(params):
            draws = torch.rand(p, generator=torch.Generator().manual_seed(seed))
            dropped[i] = draws <= ratio
        dropped[:, 0] = False  # the first point stays: it is what the others become
        where = on_device(dropped, points.device).unsqueeze(-1)
        return torch.where(where, points[:, :1].expand_as(points), points)


# What a loader's graph runs itself, from its own draws (pointcloud/loader.py).
IN_GRAPH = (RotateZ, Scale, Jitter)
