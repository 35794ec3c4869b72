"""The DALI graph for point clouds, per sample (x, y, z columns only: extra per-point columns
are not returned); the device is a parameter.

    .npy bytes, index, angle, scale, noise      (external_source, fed per batch)
      -> decoders.numpy (float32) -> bounding box and a finiteness sum
      -> transforms.translation + scale (normalize: box centre to the origin, the farthest
         point to radius 1) -> transforms.scale (s) -> transforms.rotation (angle about z)
      -> sequence_rearrange(new_order=index): sample or pad to num_points (CPU)
      -> coord_transform with that matrix (+ a scene's shift) -> + jitter
                                                          (CPU, or GPU for device="gpu")
      -> scenes (ragged): padded to the batch's largest

Nothing here is random: every parameter is drawn in numpy before the graph
(pointcloud/sample.py), so a rebuilt graph computes the same values. Besides the points the
graph outputs two small per-sample values the decode stage checks: the finiteness sum and the
box extent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shardflow import dali

UP = (0.0, 0.0, 1.0)  # rotations turn about z, the up axis of the built-in clouds and LiDAR


@dataclass(frozen=True)
class GraphSpec:
    """What the graph computes. Built once per loader (and again after a decode failure)."""

    device: Literal["cpu", "gpu"]
    normalize: bool
    jitter: bool
    shift: bool = False  # a scene's translation, fed per sample ("shift")
    # scenes keep every point (or frame_points): clouds of several sizes, padded with zeros
    # to the largest of the batch, so that the output is one dense tensor on either device
    # (the decode stage cuts each back to its length, which it knows from its index)
    ragged: bool = False


def build(spec: GraphSpec, **options: Any) -> Any:
    """The built graph (see shardflow.dali.build for `options`), fed per batch with
    `feed_input` (encoded, index, angle, scale and noise when jittering); outputs (points,
    finiteness sum, box extent) per sample."""
    return dali.build(lambda: _graph(spec), **options)


def _graph(spec: GraphSpec) -> Any:
    from nvidia.dali import fn, types

    encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
    index = fn.external_source(name="index", dtype=types.INT32, ndim=1)
    angle = fn.external_source(name="angle", dtype=types.FLOAT, ndim=0)
    scale = fn.external_source(name="scale", dtype=types.FLOAT, ndim=1)
    xyz = fn.decoders.numpy(encoded, dtype=types.FLOAT)[:, 0:3]
    # x * 0 is 0 for every finite x and NaN for NaN or Inf: the sum says whether the whole
    # cloud is finite without an overflow (a float32 sum of huge values could reach Inf).
    finite = fn.reductions.sum(xyz * 0.0)
    high, low = fn.reductions.max(xyz, axes=0), fn.reductions.min(xyz, axes=0)
    transform = _normalization(xyz, high, low) if spec.normalize else None
    transform = _then(fn.transforms.scale, transform, scale=scale)
    transform = fn.transforms.rotation(transform, angle=angle, axis=list(UP))
    if spec.shift:
        shift = fn.external_source(name="shift", dtype=types.FLOAT, ndim=1)
        transform = fn.transforms.translation(transform, offset=shift)
    points = fn.sequence_rearrange(xyz, new_order=index)  # on the CPU: fewer bytes to move
    if spec.device == "gpu":
        points = points.gpu()
    points = fn.coord_transform(points, MT=transform)
    if spec.jitter:
        noise = fn.external_source(name="noise", dtype=types.FLOAT, ndim=2)
        points = points + (noise.gpu() if spec.device == "gpu" else noise)
    if spec.ragged:
        points = fn.pad(points, axes=(0,), fill_value=0.0)
    return points, finite, high - low


def _normalization(xyz: Any, high: Any, low: Any) -> Any:
    """The transform taking the box centre to the origin and the farthest point to radius 1."""
    from nvidia.dali import fn
    from nvidia.dali import math as dmath

    centre = (high + low) * 0.5
    offset = xyz - centre
    radius = dmath.sqrt(fn.reductions.max(fn.reductions.sum(offset * offset, axes=1)))
    inverse = 1.0 / radius  # a zero radius (one position) is caught from the extent output
    moved = fn.transforms.translation(offset=-centre)
    return fn.transforms.scale(moved, scale=fn.stack(inverse, inverse, inverse))


def _then(op: Any, previous: Any, **kwargs: Any) -> Any:
    return op(**kwargs) if previous is None else op(previous, **kwargs)


class Outputs:
    """The built pipeline, with its several outputs handed over as one (GraphRunner takes one
    output per iteration)."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def feed_input(self, name: str, data: Any) -> None:
        self.pipe.feed_input(name, data)

    def schedule_run(self) -> None:
        self.pipe.schedule_run()

    def outputs(self) -> tuple[Any]:
        return (self.pipe.outputs(),)
