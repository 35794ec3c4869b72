"""The portable backend's point-cloud stage (no DALI): graph.py's math in numpy, per sample in
a thread pool, then the same value checks, voxels and batch as the DALI backend (CloudStage).

    .npy bytes (checked and made plain little-endian by sample.check_npy), the sample's
    parameters (sample.py: rows, angle, scale, noise drawn from (seed, epoch, key))
      -> x, y, z as float32 -> finiteness sum (x * 0 summed: NaN unless all finite), box
      -> the affine map graph.py builds, in the same order: translate the box centre to the
         origin and scale the farthest point to radius 1 (normalize), scale by s, rotate by
         the angle about z
      -> the kept rows, mapped, + noise

Same inputs, same float32 operations: the points equal the DALI backend's within float32
rounding (tests/test_portable.py compares them).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardflow.errors import DataError
from shardflow.loading.graphstage import Item
from shardflow.loading.portablestage import ThreadBackend
from shardflow.loading.readers import Placement
from shardflow.pointcloud.config import PointCloudConfig
from shardflow.pointcloud.decode import CloudStage
from shardflow.pointcloud.sample import SampleParams, npy_header

# (points (num_points, 3) float32, finiteness sum, box extent (3,)): graph.py's outputs
Decoded = tuple[np.ndarray, np.float32, np.ndarray]


class PortableCloudStage(CloudStage):
    """Decodes and augments with numpy in `threads` threads; the batch, its value checks and
    voxels are the DALI stage's (CloudStage)."""

    def __init__(self, cfg: PointCloudConfig, placement: Placement) -> None:
        super().__init__(cfg, placement)
        self.backend = ThreadBackend(self, cfg.threads)

    def _decode_one(self, data: np.ndarray, params: SampleParams) -> Decoded:
        try:
            xyz = decode_xyz(data)
        except (ValueError, DataError) as exc:
            self._check(data.tobytes())  # numpy's full read names the reason, as on DALI
            raise DataError(self.what, f"numpy cannot decode it: {exc}") from None
        return transform(xyz, params, bool(self.cfg.normalize))

    def _assemble(self, item: Item, decoded: list[Decoded]) -> Any:
        import torch

        if self.cfg.per_point_labels:  # ragged: a tensor per scene
            return [torch.from_numpy(d[0]) for d in decoded], \
                np.array([d[1] for d in decoded]), np.stack([d[2] for d in decoded])
        points = torch.from_numpy(np.stack([d[0] for d in decoded]))
        return points, np.array([d[1] for d in decoded]), np.stack([d[2] for d in decoded])


def decode_xyz(data: np.ndarray) -> np.ndarray:
    """x, y, z of `.npy` bytes that sample.check_npy passed (plain C-order, version 1.0, a
    real dtype) as float32 (N, 3), as DALI's numpy decoder with dtype=FLOAT gives them."""
    _version, shape, _fortran, dtype, start = npy_header(data)
    values = np.frombuffer(data, dtype=dtype, count=shape[0] * shape[1], offset=start)
    return values.reshape(shape)[:, :3].astype(np.float32)


def transform(xyz: np.ndarray, params: SampleParams, normalize: bool) -> Decoded:
    """graph.py's outputs for one cloud: its kept rows normalized, scaled, rotated about z
    and jittered; the finiteness sum; the box extent. A cloud with NaN, Inf or no extent
    gives NaN or Inf points here as in the graph: the finiteness sum and extent say why."""
    with np.errstate(all="ignore"):  # bad clouds are reported from the outputs, not here
        finite = np.float32((xyz * np.float32(0.0)).sum(dtype=np.float32))
        high, low = xyz.max(axis=0), xyz.min(axis=0)
        matrix, shift = _affine(xyz, high, low, params, normalize)
        points = xyz[params.index] @ matrix.T + shift
        if params.shift is not None:
            points = points + params.shift
        if params.noise is not None:
            points = points + params.noise
    return points.astype(np.float32, copy=False), finite, high - low


def _affine(xyz: np.ndarray, high: np.ndarray, low: np.ndarray, params: SampleParams,
            normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(3x3 matrix, shift) of x -> R(angle) s k (x - centre), graph.py's transforms composed
    in the order it chains them (k and centre only when normalizing), in float32."""
    linear, shift = np.eye(3, dtype=np.float32), np.zeros(3, dtype=np.float32)
    if normalize:
        centre = (high + low) * np.float32(0.5)
        offset = xyz - centre
        radius = np.sqrt((offset * offset).sum(axis=1, dtype=np.float32).max())
        inverse = np.float32(1.0) / radius
        linear, shift = linear * inverse, -centre * inverse
    scale = params.scales()  # per axis: a column each of the (diagonal) linear map
    radians = math.radians(params.angle)
    cos, sin = math.cos(radians), math.sin(radians)
    rotation = np.array([[cos, -sin, 0.0], [sin, cos, 0.0], [0.0, 0.0, 1.0]], np.float32)
    return rotation @ (linear * scale), rotation @ (shift * scale)
