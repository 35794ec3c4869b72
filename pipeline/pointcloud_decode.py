"""The point-cloud loader's decode stage: DALI graph (pointcloud_graph.py) -> value checks ->
voxel grid -> host or device batch -> `PointBatch`.

On the CPU the graph's points are copied out of DALI's buffer; on a GPU they are copied from
it straight into a CUDA tensor on the copier's side stream. Clouds the header could not tell
bad are found from two small per-sample outputs of the graph (NaN or Inf anywhere in x, y, z;
every point at one position) and from the points (a normalization that overflowed float32).
Voxels are computed here, in the loader's decode thread, so they overlap the consumer's step.

A batch that fails in the graph is traced to its samples: first by reading each with numpy
(pointcloud_io.py), then, for what numpy accepts, by running each sample alone through a fresh
graph. Bad samples are raised or skipped (recorded with the batch) and the rest runs again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from pipeline import pointcloud_io, resize, voxelize
from pipeline.batch import EncodedBatch, PointBatch
from pipeline.errors import DataError, SkipLog, handle
from pipeline.image_graph import GraphRunner
from pipeline.loader import Produced
from pipeline.pointcloud_graph import GraphSpec, Outputs, build_graph
from pipeline.pointcloud_sample import SampleParams
from pipeline.prefetch import DeviceCopier, dali_to_cuda

if TYPE_CHECKING:
    from pipeline.pointcloud import PointCloudConfig

Item = tuple[EncodedBatch, list[int], list[SampleParams]]  # (batch, labels, parameters)


class DecodeStage:
    """Owns the DALI graph (through a GraphRunner) and the device copier of one loader.

    Voxels are computed here, in the loader's decode thread, from the graph's points: on the
    CPU (device="cpu") with torch held to one core in this thread, so they overlap the
    training step instead of competing for its cores. With device="gpu" the points are
    already on the GPU, and the same torch code runs there on the copier's side stream:
    copying them back to the host to bin them would cost more than binning them.
    """

    def __init__(self, cfg: PointCloudConfig, device: Literal["cpu", "gpu"],
                 cuda_index: int | None) -> None:
        self.cfg, self.device, self.cuda_index = cfg, device, cuda_index
        self.spec = GraphSpec(device, cfg.normalize, cfg.train and cfg.jitter > 0)
        self.runner = GraphRunner(self._build, self._feed, self._fetch,
                                  lambda item: not len(item[0]), depth=2)
        self._copier: DeviceCopier | None = None

    def enter_thread(self) -> None:
        if self.device == "gpu":
            import torch

            torch.cuda.set_device(self.cuda_index)  # new threads start on device 0
        else:
            resize.one_core_in_this_thread()

    def run(self, prepared: Iterable[Item], stop: threading.Event) -> Iterator[Produced]:
        for item, fetched in self.runner.run(iter(prepared), self._on_failure):
            if stop.is_set():
                return
            yield self._finish(item, fetched)

    def close(self) -> None:
        self.runner.close()

    # -- the graph -------------------------------------------------------------------------

    def _build(self, depth: int, batch_size: int | None = None) -> Outputs:
        return Outputs(build_graph(self.spec, batch_size=batch_size or self.cfg.batch_size,
                                    num_threads=self.cfg.threads, device_id=self.cuda_index,
                                    seed=self.cfg.seed, prefetch_depth=depth))

    def _feed(self, graph: Outputs, item: Item) -> None:
        enc, _labels, params = item
        graph.feed_input("encoded", enc.data)
        graph.feed_input("index", [p.index for p in params])
        graph.feed_input("angle", [np.array(p.angle, np.float32) for p in params])
        graph.feed_input("scale", [np.full(3, p.scale, np.float32) for p in params])
        if self.spec.jitter:
            graph.feed_input("noise", [p.noise for p in params])

    def _fetch(self, out: Any, item: Item) -> tuple[Any, np.ndarray, np.ndarray]:
        """(points (B, num_points, 3) float32 tensor, finiteness sums, box extents), copied
        out before the graph runs again."""
        import torch

        points, finite, extent = out
        if self.device == "gpu":
            tensor = self._to_cuda(points)
        else:
            tensor = torch.from_numpy(np.array(points.as_tensor()))
        return tensor, np.array(finite.as_tensor()), np.array(extent.as_tensor())

    def _to_cuda(self, points: Any) -> Any:
        import torch

        return dali_to_cuda(points, torch.float32, self.cuda_index, self.copier.stream)

    # -- failures --------------------------------------------------------------------------

    def _on_failure(self, item: Item, exc: Exception) -> Item:
        """Drop (or raise on) the samples that made the batch fail; re-raise if none did."""
        enc, labels, params = item
        bad = self._unreadable(enc) or self._rejected_by_dali(item)
        if not bad:
            raise exc
        for i in reversed(bad):
            enc.drop(i)
            del labels[i], params[i]
        return item

    def _unreadable(self, enc: EncodedBatch) -> list[int]:
        """Samples numpy cannot read as a valid cloud; each one raised or recorded."""
        bad = []
        for i in range(len(enc)):
            try:
                pointcloud_io.read_points(enc.data[i].tobytes(), "npy",
                                          max_points=self.cfg.max_points)
            except pointcloud_io.PointCloudFormatError as exc:
                bad.append(i)
                self._handle(DataError(exc.reason, str(exc)), enc, i)
        return bad

    def _rejected_by_dali(self, item: Item) -> list[int]:
        """Samples a one-sample graph fails on (DALI refuses what numpy read)."""
        enc, labels, params = item
        bad = []
        for i in range(len(enc)):
            one: Item = (EncodedBatch([enc.keys[i]], [enc.urls[i]], [enc.data[i]],
                                      [enc.labels[i]]), [labels[i]], [params[i]])
            graph = self._build(1, batch_size=1)
            try:
                self._feed(graph, one)
                graph.schedule_run()
                graph.outputs()
            except RuntimeError as exc:
                bad.append(i)
                self._handle(DataError("bad-cloud", f"DALI cannot decode it: "
                                       f"{_dali_reason(exc)}"), enc, i)
        return bad

    def _handle(self, err: DataError, enc: EncodedBatch, i: int) -> None:
        skips = SkipLog()
        handle(err.located(source=enc.urls[i], key=enc.keys[i]), self.cfg.on_error, skips)
        enc.skips.extend(skips.entries)

    # -- after the graph -------------------------------------------------------------------

    def _finish(self, item: Item, fetched: tuple[Any, np.ndarray, np.ndarray] | None
                ) -> Produced:
        import torch

        enc, labels, _params = item
        stream = self.copier.stream
        # On a GPU the points are there already; what follows is queued on the copier's side
        # stream, and the copier's event is recorded after all of it.
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if fetched is None:  # every sample of the batch was skipped
                points = torch.zeros((0, self.cfg.num_points, 3), dtype=torch.float32,
                                     device=self.copier.device)
            else:
                points = self._drop_bad_values(enc, labels, *fetched)
            voxels = self._voxels(points)
        label = torch.tensor(labels, dtype=torch.int64)
        points, label, ready = self.copier(points, label)
        return PointBatch(points=points, label=label, keys=list(enc.keys), voxels=voxels), \
            enc.state, ready, enc.skips

    def _drop_bad_values(self, enc: EncodedBatch, labels: list[int], points: Any,
                         finite: np.ndarray, extent: np.ndarray) -> Any:
        """The rows of `points` whose clouds are finite and have an extent; the others are
        raised or recorded, and removed from `enc` and `labels`."""
        import torch

        # The output check also catches a normalization that overflowed (a tiny extent).
        usable = torch.isfinite(points.flatten(1)).all(1).tolist()  # GPU: syncs this stream
        bad: dict[int, DataError] = {}
        for i in range(len(enc)):
            if finite[i] != 0:
                bad[i] = DataError("non-finite", "x, y or z values are NaN or Inf")
            elif not extent[i].any():
                bad[i] = DataError("degenerate", "all points are at one position: zero extent")
            elif not usable[i]:
                bad[i] = DataError("non-finite", "normalizing overflowed float32 (an extent "
                                   f"of {extent[i].tolist()})")
        if not bad:
            return points
        for i, err in bad.items():
            self._handle(err, enc, i)
        for i in sorted(bad, reverse=True):
            enc.drop(i)
            del labels[i]
        return points[[i for i in range(len(usable)) if i not in bad]]

    @property
    def copier(self) -> DeviceCopier:
        if self._copier is None:
            gpu = self.device == "gpu"
            self._copier = DeviceCopier(("cuda", self.cuda_index) if gpu else "cpu", None, None,
                                        channels_first=True)
        return self._copier

    def _voxels(self, points: Any) -> Any:
        c = self.cfg
        if c.voxels is None:
            return None
        return voxelize.voxelize(points, c.voxels, grid=c.grid, extent=c.extent)


def _dali_reason(exc: Exception) -> str:
    """The operator's own words from a DALI error (which opens with the graph's traceback)."""
    text = str(exc)
    text = text.split("encountered:", 1)[-1].split("C++ context:", 1)[0]
    return " ".join(text.split())[:200]
