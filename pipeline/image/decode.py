"""The image loader's decode stage: DALI graph -> host or device batch -> `ImageBatch`.

On the CPU the graph decodes each sample's window (ROI decode) and this stage resizes, flips
and normalizes with torch (resize.py), or, with resize_on="dali", the graph does it on DALI's
CPU threads; on a GPU the graph resizes and flips and the batch is copied from DALI's buffer
straight into a CUDA tensor on the copier's side stream, normalized there. A batch that fails
to decode is traced to its samples (loading/graphstage.py), PIL being this modality's check.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from pipeline import dali
from pipeline.image import graph as image_graph
from pipeline.image import resize
from pipeline.image.augment import CropParams
from pipeline.image.config import ImageConfig
from pipeline.loading.batch import EncodedBatch, ImageBatch
from pipeline.loading.graphstage import GraphStage
from pipeline.loading.loader import Produced
from pipeline.loading.prefetch import DeviceCopier
from pipeline.samples.checks import CheckLimits, check_image

Item = tuple[EncodedBatch, list[int], list[CropParams]]  # (batch, labels, windows)


class DecodeStage(GraphStage):
    what = "bad-image"

    def __init__(self, cfg: ImageConfig, device: Literal["cpu", "gpu"],
                 cuda_index: int | None) -> None:
        self.cfg = cfg
        # "auto" reaching here (no tuning file said otherwise) is torch: measured faster on
        # the CPU (resize.py); a GPU graph always resizes.
        self.graph_resizes = device == "gpu" or cfg.resize_on == "dali"
        self.limits = CheckLimits(max_pixels=cfg.max_pixels)
        super().__init__(device, cuda_index, cfg.on_error)

    # -- the graph -------------------------------------------------------------------------

    def _spec(self) -> image_graph.GraphSpec:
        c = self.cfg
        return image_graph.GraphSpec(
            size=c.size, device=self.device, layout=c.layout, interp=c.interp,
            antialias=c.antialias, fast_idct=c.fast_idct, resize=self.graph_resizes,
            hw_decoder_load=c.hw_decoder_load,
            normalize=(c.mean, c.std) if c.normalize and self.device == "cpu" else None)

    def _build(self, depth: int, batch_size: int | None = None) -> Any:
        return image_graph.build(self._spec(), batch_size=batch_size or self.cfg.batch_size,
                                 num_threads=self.cfg.threads, device_id=self.cuda_index,
                                 seed=self.cfg.seed, prefetch_depth=depth)

    def _feed(self, graph: Any, item: Item) -> None:
        enc, _labels, windows = item
        graph.feed_input("encoded", enc.data)
        graph.feed_input("anchor", [np.array([w.x, w.y], np.int32) for w in windows])
        graph.feed_input("shape", [np.array([w.width, w.height], np.int32) for w in windows])
        if self.graph_resizes:  # else resize.py flips
            graph.feed_input("flip", [np.array(int(w.flip), np.int32) for w in windows])

    def _fetch(self, out: Any, item: Item) -> Any:
        """The graph's output as a batch tensor, copied before the graph runs again."""
        if self.device == "gpu":
            import torch

            return dali.to_cuda(out, torch.uint8, self.cuda_index, self.copier.stream)
        if self.graph_resizes:  # already the batch: copy it out of DALI's reused buffer
            import torch

            return torch.from_numpy(np.array(out.as_array()))
        c, windows = self.cfg, item[2]
        norm = (c.mean, c.std) if c.normalize else None
        return resize.batch(resize.views(out), [w.flip for w in windows], c.size,
                            c.layout == "NCHW", norm)

    def _check(self, data: bytes) -> None:
        check_image(data, self.limits)  # PIL decodes it fully

    # -- to the device ----------------------------------------------------------------------

    def _make_copier(self) -> DeviceCopier:
        c, gpu = self.cfg, self.device == "gpu"
        norm = c.normalize and gpu  # on the CPU, resize.py or the graph normalized
        return DeviceCopier(("cuda", self.cuda_index) if gpu else "cpu",
                            c.mean if norm else None, c.std if norm else None,
                            c.layout == "NCHW")

    def _finish(self, item: Item, images: Any) -> Produced:
        import torch

        enc, labels, _windows = item
        if images is None:  # every sample of the batch was skipped
            images = self._empty()
        label = torch.tensor(labels, dtype=torch.int64)
        image, label, ready = self.copier(self.copier.pinned(images), label)
        return ImageBatch(image=image, label=label, keys=list(enc.keys)), enc.state, ready, \
            enc.skips

    def _empty(self) -> Any:
        import torch

        c = self.cfg
        shape = (0, 3, c.size, c.size) if c.layout == "NCHW" else (0, c.size, c.size, 3)
        return torch.zeros(shape, dtype=torch.float32 if c.normalize else torch.uint8)
