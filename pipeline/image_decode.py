"""The image loader's decode stage: DALI graph -> host or device batch -> `Batch`.

On the CPU the graph decodes each sample's window (ROI decode) and this stage resizes, flips
and normalizes with torch (resize.py), or, with resize_on="dali", the graph does it on DALI's
CPU threads; on a GPU the graph resizes and flips and the batch is copied from DALI's buffer
straight into a CUDA tensor on the copier's side stream, normalized there.

A batch that fails to decode is traced to its samples: first by decoding each with PIL, then,
for what PIL accepts, by running each sample alone through a fresh graph. Bad samples are
raised or skipped (recorded with the batch) and the rest is decoded again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from pipeline import image_graph, resize
from pipeline.batch import Batch, EncodedBatch
from pipeline.checks import CheckLimits, check_image
from pipeline.errors import DataError, OnError, SkipLog, handle
from pipeline.loader import Produced
from pipeline.prefetch import DeviceCopier, dali_to_cuda

Item = tuple[EncodedBatch, list[Any]]  # (batch, [labels, windows])


class DecodeStage:
    """Owns the DALI graph (through a GraphRunner) and the device copier of one loader."""

    def __init__(self, cfg: Any, device: Literal["cpu", "gpu"], cuda_index: int | None,
                 batch_size: int) -> None:
        self.cfg, self.device, self.cuda_index = cfg, device, cuda_index
        self.batch_size = batch_size
        self.on_error: OnError = cfg.on_error
        # "auto" reaching here (no tuning file said otherwise) is torch: measured faster on
        # the CPU (resize.py); a GPU graph always resizes.
        self.graph_resizes = device == "gpu" or cfg.resize_on == "dali"
        self.runner = image_graph.GraphRunner(self._build, self._feed, self._fetch,
                                              lambda item: not len(item[0]), depth=2)
        self._copier: DeviceCopier | None = None

    def enter_thread(self) -> None:
        """Per-thread settings for the thread that runs this stage."""
        if self.device == "gpu":
            import torch

            torch.cuda.set_device(self.cuda_index)  # new threads start on device 0
        else:
            resize.one_core_in_this_thread()

    def run(self, prepared: Iterator[Item], stop: threading.Event) -> Iterator[Produced]:
        for (enc, (labels, _)), images in self.runner.run(prepared, self._on_failure):
            if stop.is_set():
                return
            yield self._to_device(enc, labels, images)

    def close(self) -> None:
        self.runner.close()

    # -- the graph -------------------------------------------------------------------------

    def _spec(self) -> image_graph.GraphSpec:
        c = self.cfg
        return image_graph.GraphSpec(
            size=c.size, device=self.device, layout=c.layout, interp=c.interp,
            antialias=c.antialias, fast_idct=c.fast_idct, resize=self.graph_resizes,
            hw_decoder_load=c.hw_decoder_load,
            normalize=(c.mean, c.std) if c.normalize and self.device == "cpu" else None)

    def _build(self, depth: int) -> Any:
        return image_graph.build(self._spec(), batch_size=self.batch_size,
                                 num_threads=self.cfg.threads, device_id=self.cuda_index,
                                 seed=self.cfg.seed, prefetch_depth=depth)

    def _feed(self, graph: Any, item: Item) -> None:
        enc, (_labels, windows) = item
        graph.feed_input("encoded", enc.data)
        graph.feed_input("anchor", [np.array([w.x, w.y], np.int32) for w in windows])
        graph.feed_input("shape", [np.array([w.width, w.height], np.int32) for w in windows])
        if self.graph_resizes:  # else resize.py flips
            graph.feed_input("flip", [np.array(int(w.flip), np.int32) for w in windows])

    def _fetch(self, out: Any, item: Item) -> Any:
        """The graph's output as a batch tensor, copied before the graph runs again."""
        if self.device == "gpu":
            return self._to_cuda(out)
        if self.graph_resizes:  # already the batch: copy it out of DALI's reused buffer
            import torch

            return torch.from_numpy(np.array(out.as_array()))
        c, windows = self.cfg, item[1][1]
        norm = (c.mean, c.std) if c.normalize else None
        return resize.batch(resize.views(out), [w.flip for w in windows], c.size,
                            c.layout == "NCHW", norm)

    def _to_cuda(self, out: Any) -> Any:
        import torch

        return dali_to_cuda(out, torch.uint8, self.cuda_index, self.copier.stream)

    # -- failures ----------------------------------------------------------------------------

    def _on_failure(self, item: Item, exc: Exception) -> Item:
        """Drop (or raise on) the samples that made the batch fail; re-raise if none did."""
        enc, (labels, windows) = item
        bad = self._undecodable(enc) or self._rejected_by_dali(item)
        if not bad:
            raise exc
        for i in reversed(bad):
            for column in (enc.keys, enc.urls, enc.data, enc.labels, labels, windows):
                del column[i]
        return item

    def _undecodable(self, enc: EncodedBatch) -> list[int]:
        """Samples PIL cannot decode fully; each one raised or recorded with the batch."""
        bad, limits = [], CheckLimits(max_pixels=self.cfg.max_pixels)
        for i in range(len(enc)):
            try:
                check_image(enc.data[i].tobytes(), limits)
            except DataError as err:
                bad.append(i)
                self._handle(err, enc, i)
        return bad

    def _rejected_by_dali(self, item: Item) -> list[int]:
        """Samples a one-sample graph fails on (DALI refuses what PIL accepted)."""
        enc, (labels, windows) = item
        bad = []
        for i in range(len(enc)):
            one: Item = (EncodedBatch([enc.keys[i]], [enc.urls[i]], [enc.data[i]],
                                      [enc.labels[i]]), [[labels[i]], [windows[i]]])
            graph = self._build(1)
            try:
                self._feed(graph, one)
                graph.schedule_run()
                graph.outputs()
            except RuntimeError as exc:
                bad.append(i)
                self._handle(DataError("bad-image", f"DALI cannot decode it ({str(exc)[:200]})"),
                             enc, i)
        return bad

    def _handle(self, err: DataError, enc: EncodedBatch, i: int) -> None:
        skips = SkipLog()
        handle(err.located(source=enc.urls[i], key=enc.keys[i]), self.on_error, skips)
        enc.skips.extend(skips.entries)

    # -- to the device ----------------------------------------------------------------------

    @property
    def copier(self) -> DeviceCopier:
        if self._copier is None:
            c, gpu = self.cfg, self.device == "gpu"
            norm = c.normalize and gpu  # on the CPU, resize.py or the graph normalized
            self._copier = DeviceCopier(
                ("cuda", self.cuda_index) if gpu else "cpu", c.mean if norm else None,
                c.std if norm else None, c.layout == "NCHW")
        return self._copier

    def _to_device(self, enc: EncodedBatch, labels: list[int], images: Any) -> Produced:
        import torch

        if images is None:  # every sample of the batch was skipped
            images = self._empty()
        label = torch.tensor(labels, dtype=torch.int64)
        image, label, ready = self.copier(self.copier.pinned(images), label)
        return Batch(image=image, label=label, keys=list(enc.keys)), enc.state, ready, enc.skips

    def _empty(self) -> Any:
        import torch

        c = self.cfg
        shape = (0, 3, c.size, c.size) if c.layout == "NCHW" else (0, c.size, c.size, 3)
        return torch.zeros(shape, dtype=torch.float32 if c.normalize else torch.uint8)
