"""The point-cloud loader's decode stage: DALI graph (pointcloud/graph.py) -> value checks ->
voxel grid -> host or device batch -> `PointBatch`.

On the CPU the graph's points are copied out of DALI's buffer; on a GPU they are copied from
it straight into a CUDA tensor on the copier's side stream. Clouds the header could not tell
bad are found from two small per-sample outputs of the graph (NaN or Inf anywhere in x, y, z;
every point at one position) and from the points (a normalization that overflowed float32).
Voxels are computed here, in the loader's decode thread, so they overlap the consumer's step.

A batch that fails in the graph is traced to its samples (loading/graphstage.py), numpy
(samples/pointcloud_io.py) being this modality's check. `CloudStage` is what this stage
shares with the portable backend's (portable.py); each holds its backend, none derives from
one.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from shardflow import dali
from shardflow.errors import DataError
from shardflow.loading.batch import EncodedBatch, PointBatch
from shardflow.loading.delivery import DeviceCopier
from shardflow.loading.graphstage import DecodeCore, GraphBackend
from shardflow.loading.loader import Produced
from shardflow.loading.readers import Placement
from shardflow.pointcloud import graph as pointcloud_graph
from shardflow.pointcloud import scene, voxelize
from shardflow.pointcloud.config import PointCloudConfig
from shardflow.pointcloud.sample import SampleParams
from shardflow.samples import pointcloud_io
from shardflow.samples.scans import NO_IGNORE

Item = tuple[EncodedBatch, list[int], list[SampleParams]]  # (batch, labels, parameters)
# Box sides (largest of a cloud's three) whose normalization stays well inside float32.
SAFE_SIDES = (1e-15, 1e18)


class CloudStage(DecodeCore):
    """What the point-cloud decode stages share on either backend (the DALI graph's below, the
    portable one in portable.py): numpy as the check, and from (points, finiteness sums, box
    extents) the value checks, voxels, offsets and the batch on the device.

    Voxels are computed here, in the loader's decode thread, from the decoded points: on the
    CPU (device="cpu") with torch held to one core in this thread, so they overlap the
    training step instead of competing for its cores. With device="gpu" the points are
    already on the GPU, and the same torch code runs there on the copier's side stream:
    copying them back to the host to bin them would cost more than binning them.
    """

    what = "bad-cloud"
    ignore_label = NO_IGNORE  # a scene loader's (set by the loader)

    def __init__(self, cfg: PointCloudConfig, placement: Placement) -> None:
        super().__init__(placement, cfg.on_error, cfg.prefetch)
        self.cfg = cfg

    def _check(self, data: bytes) -> None:
        try:
            pointcloud_io.read_points(data, "npy", max_points=self.cfg.max_points)
        except pointcloud_io.PointCloudFormatError as exc:
            raise DataError(exc.reason, str(exc)) from None

    # -- after the graph -------------------------------------------------------------------

    def _finish(self, item: Item, fetched: tuple[Any, np.ndarray, np.ndarray] | None
                ) -> Produced:
        import torch

        if self.cfg.per_point_labels:
            return scene.finish(self, item, fetched)
        enc, labels, _params = item
        gpu = self.decode == "gpu"
        # Decoded on a GPU, the points are there already and what follows is queued on the
        # copier's side stream (the stream contract); decoded on the CPU, it runs here, in
        # this thread, and the copier moves the results.
        with torch.cuda.stream(self.copier.stream) if gpu else contextlib.nullcontext():
            if fetched is None:  # every sample of the batch was skipped
                points = torch.zeros((0, self.cfg.num_points, 3), dtype=torch.float32,
                                     device=self.copier.device if gpu else "cpu")
            else:
                points = self._drop_bad_values(enc, labels, *fetched)
            points = self._augmented(points, enc.keys)
            voxels = self._voxels(points)
        label = torch.tensor(labels, dtype=torch.int64) if self.cfg.labels else None
        (points, label, voxels, offset), ready = self.copier.move(points, label, voxels,
                                                                  scene.offsets_of(enc))
        return PointBatch(points=points, label=label, keys=list(enc.keys), voxels=voxels,
                          offset=offset), enc.state, ready, enc.skips

    def _drop_bad_values(self, enc: EncodedBatch, labels: list[int], points: Any,
                         finite: np.ndarray, extent: np.ndarray) -> Any:
        """The rows of `points` whose clouds are finite and have an extent; the others are
        raised or recorded, and removed from `enc` and `labels`."""
        usable = self._usable(points, extent)
        count = len(enc)
        bad: dict[int, DataError] = {}
        for i in range(count):
            if finite[i] != 0:
                bad[i] = DataError("non-finite", "x, y or z values are NaN or Inf")
            elif not extent[i].any():
                bad[i] = DataError("degenerate", "all points are at one position: zero extent")
            elif usable is not None and not usable[i]:
                bad[i] = DataError("non-finite", "normalizing overflowed float32 (an extent "
                                   f"of {extent[i].tolist()})")
        if not bad:
            return points
        for i, err in bad.items():
            self._handle(err, enc, i)
        for i in sorted(bad, reverse=True):
            enc.drop(i)
            del labels[i]
        return points[[i for i in range(count) if i not in bad]]

    def _usable(self, points: Any, extent: np.ndarray) -> list[bool] | None:
        """Per cloud, whether its points came out finite; None when none can have overflowed.
        Reading the points' finiteness back costs a wait for the stream on a GPU, every
        batch: it is read only where the box extents (host values already) allow an
        overflow. Normalizing divides by the radius, between 0.5 and 0.87 of the box's
        largest side: a side below ~1e-19 underflows the squares (the radius reads 0), one
        above ~1e19 overflows them. Unnormalized, the scale augmentation can overflow
        coordinates near float32's limit, which the extent does not show: always read."""
        import torch

        sides = extent.max(axis=1) if len(extent) else np.zeros(0)
        risky = (sides > 0) & ((sides < SAFE_SIDES[0]) | (sides > SAFE_SIDES[1]))
        if self.cfg.normalize and not risky.any():
            return None
        return torch.isfinite(points.flatten(1)).all(1).tolist()  # type: ignore[no-any-return]

    def _augmented(self, points: Any, keys: list[str]) -> Any:
        """augment's ops after the graph's (config.split_augment), in torch, here: on the
        CPU, or queued on the copier's stream where the graph decoded on a GPU."""
        torch_ops = self.cfg.torch_ops()
        if not torch_ops or not len(points):
            return points
        from shardflow import ops

        return ops.points.apply(torch_ops, points, ops.sample_rngs(self.cfg.seed, self.epoch,
                                                                   keys))

    def _make_copier(self) -> DeviceCopier:
        cuda = self.placement.target == "cuda"
        return DeviceCopier(("cuda", self.cuda_index) if cuda else "cpu", None, None,
                            channels_first=True, slots=self.prefetch + 2)

    def _voxels(self, points: Any) -> Any:
        c = self.cfg
        if c.voxels is None:
            return None
        return voxelize.voxelize(points, c.voxels, grid=c.grid, extent=c.extent)


class DecodeStage(CloudStage):
    """The DALI backend's point-cloud stage: the graph decodes, normalizes, samples and
    augments (graph.py)."""

    def __init__(self, cfg: PointCloudConfig, placement: Placement) -> None:
        super().__init__(cfg, placement)
        spec = cfg.augment_spec()
        self.spec = pointcloud_graph.GraphSpec(
            placement.decode, bool(cfg.normalize), cfg.train and spec.jitter > 0,
            shift=cfg.train and spec.translate > 0, ragged=cfg.per_point_labels)
        self.graph = self.backend = GraphBackend(self, placement, cfg.prefetch)

    # -- the graph -------------------------------------------------------------------------

    def _build(self, depth: int, batch_size: int | None = None) -> pointcloud_graph.Outputs:
        graph = pointcloud_graph.build(self.spec, batch_size=batch_size or self.cfg.batch_size,
                                       num_threads=self.cfg.threads,
                                       device_id=self.graph.graph_device,
                                       seed=self.cfg.seed, prefetch_depth=depth)
        return pointcloud_graph.Outputs(graph)

    def _feed(self, graph: pointcloud_graph.Outputs, item: Item) -> None:
        enc, _labels, params = item
        graph.feed_input("encoded", enc.data)
        graph.feed_input("index", [p.index for p in params])
        graph.feed_input("angle", [np.array(p.angle, np.float32) for p in params])
        graph.feed_input("scale", [p.scales() for p in params])
        if self.spec.shift:
            graph.feed_input("shift", [p.shift for p in params])
        if self.spec.jitter:
            graph.feed_input("noise", [p.noise for p in params])

    def _fetch(self, out: Any, item: Item) -> tuple[Any, np.ndarray, np.ndarray]:
        """(points (B, num_points, 3) float32 tensor, finiteness sums, box extents), copied
        out before the graph runs again."""
        import torch

        points, finite, extent = out
        if self.decode == "gpu":
            tensor = dali.to_cuda(points, torch.float32, self.cuda_index,
                                  self.copier.stream, self.graph.runner.fence)
        else:
            tensor = torch.from_numpy(np.array(points.as_tensor()))
        if self.spec.ragged:  # each scene cut back to its own rows (views of the copy)
            tensor = [tensor[i, : len(p.index)] for i, p in enumerate(item[2])]
        return tensor, np.array(finite.as_tensor()), np.array(extent.as_tensor())
