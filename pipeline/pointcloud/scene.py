"""Scenes labelled per point (pointcloud_loader per_point_labels=True): the decode stage's last
step to a ragged `ScanBatch` (the labels' check of the reader stage is samples/scans.py's).

    reader stage: KEY.labels.npy -> header: 1-D, integer, one label per point of KEY.npy
      -> values: each a class in [0, num_classes) or the ignore label -> kept as read
         (samples/scans.check_labels, which ShardDataset uses too)
    decode stage (either backend): each scene's points (augmented: sample.scene_params)
      -> bad values found as for clouds (NaN, Inf, one position) -> raised or skipped
      -> labels of the kept rows -> training: the crop (range, box) on points and labels alike
         (a frame with no point within crop_range: raised or skipped, `empty-after-crop`)
      -> concatenated, offsets -> sparse voxels with majority labels (segvoxels.py)
      -> moved to the device -> ScanBatch

Ragged, not padded: a scene of 120,000 points beside one of 60,000 would carry 60,000 padded
points (and a mask) through every step; concatenated rows with offsets are what point and
sparse-voxel networks take. Everything here runs in the loader's decode thread, so the
voxelization overlaps the training step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from shardflow.errors import DataError
from shardflow.loading.batch import ScanBatch
from shardflow.loading.loader import Produced
from shardflow.pointcloud import segvoxels
from shardflow.pointcloud.sample import SampleParams
from shardflow.samples.pointcloud_io import OFFSET_EXT


def finish(stage: Any, item: tuple[Any, list[np.ndarray], list[SampleParams]],
           fetched: tuple[list[Any], np.ndarray, np.ndarray] | None) -> Produced:
    """The ScanBatch of `item` from the graph's (or the portable stage's) points."""
    import torch

    enc, labels, params = item
    pieces = [] if fetched is None else _good(stage, item, *fetched)
    gpu = stage.decode == "gpu"
    with torch.cuda.stream(stage.copier.stream) if gpu else contextlib.nullcontext():
        device = pieces[0].device if pieces else torch.device("cpu")
        frames = [_frame(stage.cfg, p, lab, par, device)
                  for p, lab, par in zip(pieces, labels, params, strict=True)]
        _drop_empty(stage, item, frames)
        points, point_labels, offsets, frame = _joined(frames, device)
        rows = None
        grid = stage.cfg.voxel_grid()
        if grid is not None:
            rows = segvoxels.voxel_rows(points, frame, point_labels, grid, stage.ignore_label)
    moved, ready = stage.copier.move(
        points, offsets, point_labels, *(_rows(rows) if rows else (None,) * 4), offsets_of(enc))
    batch = ScanBatch(points=moved[0], offsets=moved[1], labels=moved[2], keys=list(enc.keys),
                      ignore_label=stage.ignore_label, voxel_coords=moved[3],
                      voxel_labels=moved[4], voxel_counts=moved[5], point_voxel=moved[6],
                      grid=grid.dims if grid else None, offset=moved[7])
    return batch, enc.state, ready, enc.skips


def _good(stage: Any, item: tuple[Any, ...], pieces: list[Any], finite: np.ndarray,
          extent: np.ndarray) -> list[Any]:
    """The scenes whose points are finite and have an extent; the others raised or
    recorded, and removed from every column of `item`."""
    import torch

    enc = item[0]
    # The augmented points too: a scale or shift can overflow float32 near its limit. One
    # read for the batch (a host sync on a GPU, in this thread).
    out = torch.stack([torch.isfinite(p).all() for p in pieces]).tolist() if pieces else []
    bad: dict[int, DataError] = {}
    for i in range(len(enc)):
        if finite[i] != 0:
            bad[i] = DataError("non-finite", "x, y or z values are NaN or Inf")
        elif not extent[i].any():
            bad[i] = DataError("degenerate", "all points are at one position: zero extent")
        elif not out[i]:
            bad[i] = DataError("non-finite", "augmenting overflowed float32 (coordinates of "
                               f"{extent[i].max():.3g} m extent)")
    for i, err in bad.items():
        stage._handle(err, enc, i)
    for i in sorted(bad, reverse=True):
        enc.drop(i)
        for column in item[1:]:
            del column[i]
        del pieces[i]
    return pieces


def _drop_empty(stage: Any, item: tuple[Any, ...], frames: list[tuple[Any, Any]]) -> None:
    """Raise or record the frames the crop left without a point (no point within crop_range
    of the sensor), and remove them from `frames` and every column of `item`: a scene of 0
    points would be a sample with nothing to learn from, passed on as if read."""
    enc = item[0]
    empty = [i for i, (points, _) in enumerate(frames) if not len(points)]
    for i in empty:
        stage._handle(DataError("empty-after-crop", "no point of the frame lies within "
                                f"crop_range={stage.cfg.crop_range} m of the sensor (x, y)"),
                      enc, i)
    for i in reversed(empty):
        enc.drop(i)
        for column in item[1:]:
            del column[i]
        del frames[i]


def _frame(cfg: Any, points: Any, labels: np.ndarray, params: SampleParams, device: Any
           ) -> tuple[Any, Any]:
    """One scene's (points, int64 labels) of its kept rows, cropped when training."""
    import torch

    kept = torch.from_numpy(labels[params.index].astype(np.int64))
    kept = kept.to(device, non_blocking=True) if device.type == "cuda" else kept
    if not cfg.train:
        return points, kept
    keep = None
    if cfg.crop_range is not None:
        keep = points[:, 0] ** 2 + points[:, 1] ** 2 <= cfg.crop_range**2
    if cfg.crop_box is not None and params.centre is not None:
        # the box centres on a point within the range, when there is one: never a box
        # around a point the range crop has taken away (an empty scene)
        among = torch.nonzero(keep).flatten() if keep is not None else None
        row = params.centre if among is None or not len(among) else \
            int(among[params.centre % len(among)])
        centre = points[row, :2]
        half = torch.tensor(cfg.crop_box, device=points.device) / 2
        inside = ((points[:, :2] - centre).abs() <= half).all(dim=1)
        keep = inside if keep is None else keep & inside
    return (points, kept) if keep is None else (points[keep], kept[keep])


def _joined(frames: list[tuple[Any, Any]], device: Any) -> tuple[Any, Any, Any, Any]:
    """(points (P, 3), labels (P,), offsets (B + 1,), each point's frame (P,))."""
    import torch

    lengths = [len(p) for p, _ in frames]
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    if not frames:
        return torch.zeros((0, 3)), torch.zeros(0, dtype=torch.int64), offsets, \
            torch.zeros(0, dtype=torch.int64)
    frame = torch.repeat_interleave(torch.arange(len(frames)), torch.tensor(lengths))
    points = torch.cat([p for p, _ in frames]).contiguous()
    labels = torch.cat([lab for _, lab in frames])
    return points, labels, offsets, frame.to(device)


def _rows(rows: segvoxels.VoxelRows) -> tuple[Any, Any, Any, Any]:
    return rows.coords, rows.labels, rows.counts, rows.point_voxel


def offsets_of(enc: Any) -> Any:
    """float64 (B, 3): each cloud's or scene's make_shards offset (parsed by the loader's
    check), zeros where none."""
    import torch

    column = enc.extras.get(OFFSET_EXT) or [None] * len(enc)
    rows = [np.zeros(3) if o is None else o for o in column]
    return torch.from_numpy(np.stack(rows) if rows else np.zeros((0, 3)))
