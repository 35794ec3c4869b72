"""The image loader's decode stage: DALI graph -> host or device batch -> `ImageBatch`.

On the CPU the graph decodes each sample's window (ROI decode) and this stage resizes, flips
and normalizes with torch (resize.py), or, with resize_on="dali", the graph does it on DALI's
CPU threads; on a GPU the graph resizes and flips and the batch is copied from DALI's buffer
straight into a CUDA tensor on the copier's side stream, normalized there. A batch that fails
to decode is traced to its samples (loading/graphstage.py), PIL being this modality's check.
`ImageStage` is what this stage shares with the portable backend's (portable.py); each holds
its backend (graphstage.GraphBackend, portablestage.ThreadBackend), none derives from one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from shardflow import dali
from shardflow.image import batchops, resize
from shardflow.image import graph as image_graph
from shardflow.image.batchops import BatchOps
from shardflow.image.config import ImageConfig
from shardflow.loading.batch import EncodedBatch, ImageBatch
from shardflow.loading.delivery import DeviceCopier
from shardflow.loading.graphstage import DecodeCore, GraphBackend
from shardflow.loading.hostpool import HostPool
from shardflow.loading.loader import Produced
from shardflow.loading.prefetch import ahead, one_core_in_this_thread
from shardflow.loading.readers import Placement
from shardflow.samples.checks import CheckLimits, allow_pixels, check_image

# (batch, labels (None each with labels=False), windows: a CropParams each, or with views a
# tuple of one per view)
Item = tuple[EncodedBatch, list[int | None], list[Any]]
# Helper threads a CPU loader's ops (batchops.py) run in, a batch each, while this stage's
# thread resizes the next: as many as the loader's decode threads, OPS_WORKERS to 8.
# Measured on 2 cores (threads=2), RandAugment + mixup against the torchvision-style recipe,
# 5 paired rounds: 1.35x with 2 helpers, 1.29x with 1, 1.18x with 3.
OPS_WORKERS = 2


class ImageStage(DecodeCore):
    """What the image decode stages share on either backend (the DALI graph's below, the
    portable one in portable.py): PIL as the check, the windows resized on the CPU by
    resize.py, the batch with its labels and extras, the copier to the device."""

    what = "bad-image"

    def __init__(self, cfg: ImageConfig, placement: Placement, batch_ops: BatchOps | None
                 ) -> None:
        super().__init__(placement, cfg.on_error, cfg.prefetch)
        self.cfg = cfg
        # The user's ops (batchops.py): run here for a CPU loader, on the batches of the
        # epoch the loader set before the pass; a GPU loader runs them after delivery.
        self.batch_ops = None if batchops.after_delivery(placement) else batch_ops
        # The leading ops the DALI graph runs (DecodeStage, where the graph resizes); the
        # rest run in torch after it (batchops.py, told how many are done).
        self.graph_ops: tuple[Any, ...] = ()
        # Several views (views.py): every sample's V windows decoded, each view resized to
        # its size; None: one window a sample, resized to cfg.size.
        self.views = batch_ops.views if batch_ops is not None else None
        self.per_sample = len(self.views) if self.views is not None else 1
        # uint8 crosses the bus: a batch bound for a GPU is normalized there, by the copier.
        # The ops take uint8: with ops, normalization is theirs to do last.
        self.host_normalizes = cfg.normalize and placement.target == "cpu" and \
            batch_ops is None
        self.device_normalizes = cfg.normalize and placement.target == "cuda" and \
            batch_ops is None
        self.limits = CheckLimits(max_pixels=cfg.max_pixels)
        allow_pixels(cfg.max_pixels)  # the portable decode, and masks, open with PIL
        # Batch buffers written again once the consumer let go of them (hostpool.py): the
        # prefetch queue's batches, the one being made, the one in use, and one more; with
        # CPU ops, those their helpers hold too (up to one more than they run at once)
        self.helpers = min(max(OPS_WORKERS, cfg.threads), 8) if self.batch_ops else 0
        self.pool = HostPool(cfg.prefetch + 3 + (self.helpers + 1 if self.helpers else 0))

    def _resized(self, images: list[Any], windows: list[Any]) -> Any:
        """Decoded windows (HWC uint8, as stored) as the batch tensor: resized, turned
        upright, flipped, laid out (and normalized for the CPU). With views, `images` and
        `windows` hold each sample's V, and the result is a list of V batch tensors."""
        c = self.cfg
        if self.views is not None:
            return [resize.batch([s[v] for s in images], [w[v].flip for w in windows],
                                 view.size, c.layout == "NCHW", None,
                                 [(w[v].transpose, w[v].vflip) for w in windows])
                    for v, view in enumerate(self.views)]
        norm = (c.mean, c.std) if self.host_normalizes else None
        out = self.pool.take(*resize.batch_shape(len(images), c.size, c.layout == "NCHW",
                                                 norm is not None))
        return resize.batch(images, [w.flip for w in windows], c.size, c.layout == "NCHW",
                            norm, [(w.transpose, w.vflip) for w in windows], out=out)

    def _check(self, data: bytes) -> None:
        check_image(data, self.limits)  # PIL decodes it fully

    # -- to the device ----------------------------------------------------------------------

    def _make_copier(self) -> DeviceCopier:
        c, cuda = self.cfg, self.placement.target == "cuda"
        norm = self.device_normalizes  # for the CPU, resize.py or the graph normalized
        return DeviceCopier(("cuda", self.cuda_index) if cuda else "cpu",
                            c.mean if norm else None, c.std if norm else None,
                            c.layout == "NCHW", slots=self.prefetch + 2)

    def _finish(self, item: Item, images: Any) -> Produced:
        import torch

        enc, labels, _windows = item
        if images is None:  # every sample of the batch was skipped
            images = self._empty()
        # labels=False: an empty tensor rides along where the labels would (the copier takes
        # a tensor there), and the batch says None.
        label = torch.tensor(labels if self.cfg.labels else [], dtype=torch.int64)
        views, targets = None, None
        if self.views is not None or self.cfg.targets:  # one copy of all, one ready event
            tensors = images if self.views is not None else [images]
            maps = self._masks(_windows) if self.cfg.targets else {}
            (*moved, label), ready = self.copier.move(*tensors, *maps.values(), label)
            image = moved[0]
            views = moved[:len(tensors)] if self.views is not None else None
            targets = dict(zip(maps, moved[len(tensors):], strict=True)) or None
        else:
            image, label, ready = self.copier(images, label)
        extras = {ext: list(enc.extras.get(ext, [])) for ext in self.cfg.extras}
        batch = ImageBatch(image=image, label=label if self.cfg.labels else None,
                           keys=list(enc.keys), extras=extras or None, views=views,
                           targets=targets)
        return batch, enc.state, ready, enc.skips

    def run(self, prepared: Any, stop: Any) -> Iterator[Produced]:
        """The backend's batches; with the user's ops on the CPU, each batch then through
        them in helper threads (OPS_WORKERS or more), while this thread resizes the next: in this
        thread, after the resize, the two ran one after the other, and with DALI's threads
        waiting on them the loader used 1.4 of 2 cores (RandAugment + mixup)."""
        produced = super().run(prepared, stop)
        if self.batch_ops is None:
            return produced
        return self._augmented(produced, self.batch_ops, self.epoch)

    def _augmented(self, produced: Iterator[Produced], ops_: BatchOps, epoch: int
                   ) -> Iterator[Produced]:
        done = len(self.graph_ops)

        def augment(p: Produced) -> Produced:
            batch, *rest = p
            return (ops_(batch, epoch, done=done), *rest)  # type: ignore[return-value]

        workers = self.helpers
        for _, out in ahead(augment, ((None, p) for p in produced), depth=workers,
                            name="shardflow-image-ops", workers=workers,
                            initializer=one_core_in_this_thread):
            yield out

    def _masks(self, windows: list[Any]) -> dict[str, Any]:
        """Each target's masks for the batch (N, size, size), from the cuts the reader stage
        made (augment.MaskedCrop), resized and turned as the images are."""
        turns = [(w.transpose, w.vflip, w.flip) for w in windows]
        return {name: (resize.values_batch if name in self.cfg.value_targets
                       else resize.mask_batch)([w.masks[j] for w in windows], turns,
                                               self.cfg.size)
                for j, (name, _) in enumerate(self.cfg.targets)}

    def _empty(self) -> Any:
        import torch

        c = self.cfg
        if self.views is not None:
            return [torch.zeros((0, 3, v.size, v.size) if c.layout == "NCHW" else
                                (0, v.size, v.size, 3), dtype=torch.uint8) for v in self.views]
        shape = (0, 3, c.size, c.size) if c.layout == "NCHW" else (0, c.size, c.size, 3)
        return torch.zeros(shape, dtype=torch.float32 if self.host_normalizes else torch.uint8)


def in_graph(ops_: tuple[Any, ...]) -> tuple[Any, ...]:
    """The leading ops with a DALI form: the graph runs an op only when every op before it
    ran there too (the draws, and the pixels, keep their order)."""
    lead = []
    for op in ops_:
        if not op.dali_inputs:
            break
        lead.append(op)
    return tuple(lead)


class DecodeStage(ImageStage):
    """The DALI backend's image stage: the graph decodes each window (and, on a GPU or with
    resize_on="dali", resizes and flips it)."""

    def __init__(self, cfg: ImageConfig, placement: Placement, batch_ops: BatchOps | None
                 ) -> None:
        super().__init__(cfg, placement, batch_ops)
        # "auto" reaching here (no tuning file said otherwise) is torch: measured faster on
        # the CPU (resize.py); a GPU graph always resizes. Views are resized by resize.py,
        # each to its size (a GPU loader with views decodes on the CPU: loader.py).
        self.graph_resizes = (placement.decode == "gpu" or cfg.resize_on == "dali") and \
            self.views is None
        if self.graph_resizes and batch_ops is not None and not cfg.targets:
            self.graph_ops = in_graph(batch_ops.ops)
        self.graph = self.backend = GraphBackend(self, placement, cfg.prefetch)

    # -- the graph -------------------------------------------------------------------------

    def _spec(self) -> image_graph.GraphSpec:
        c = self.cfg
        return image_graph.GraphSpec(
            size=c.size, device=self.decode, layout=c.layout, interp=c.interp,
            antialias=c.antialias, fast_idct=c.fast_idct, resize=self.graph_resizes,
            hw_decoder_load=c.hw_decoder_load, exif_orientation=c.exif_orientation,
            normalize=(c.mean, c.std) if self.host_normalizes else None, ops=self.graph_ops)

    def _build(self, depth: int, batch_size: int | None = None) -> Any:
        samples = (batch_size or self.cfg.batch_size) * self.per_sample  # a window each
        return image_graph.build(self._spec(), batch_size=samples,
                                 num_threads=self.cfg.threads,
                                 device_id=self.graph.graph_device,
                                 seed=self.cfg.seed, prefetch_depth=depth)

    def _feed(self, graph: Any, item: Item) -> None:
        enc, _labels, windows = item
        data = enc.data
        if self.views is not None:  # each sample's bytes once per view, with its window
            data = [d for d in data for _ in range(self.per_sample)]
            windows = [w for ws in windows for w in ws]
        graph.feed_input("encoded", data)
        graph.feed_input("anchor", [np.array([w.x, w.y], np.int32) for w in windows])
        graph.feed_input("shape", [np.array([w.width, w.height], np.int32) for w in windows])
        if self.graph_resizes:  # else resize.py flips
            graph.feed_input("flip", [np.array(int(w.flip), np.int32) for w in windows])
        if self.graph_resizes and self.cfg.exif_orientation:  # else resize.py turns them
            graph.feed_input("orient", [np.array(image_graph.orient_matrix(
                w.transpose, w.vflip, self.cfg.size), np.float32) for w in windows])
        if self.graph_ops:
            self._feed_ops(graph, enc.keys)

    def _feed_ops(self, graph: Any, keys: list[str]) -> None:
        """The graph's ops' per-sample inputs, drawn as ops.apply draws them (each sample's
        generator, op after op), so torch's ops after them continue the same draws."""
        from shardflow import ops

        rngs = ops.sample_rngs(self.cfg.seed, self.epoch, keys)
        for j, op in enumerate(self.graph_ops):
            values = op.dali_values([op.draw(rng) for rng in rngs], self.cfg.size,
                                    self.cfg.size)
            for name, column in values.items():
                graph.feed_input(f"op{j}_{name}", column)

    def _fetch(self, out: Any, item: Item) -> Any:
        """The graph's output as a batch tensor, copied before the graph runs again."""
        if self.decode == "gpu":
            import torch

            return dali.to_cuda(out, torch.uint8, self.cuda_index, self.copier.stream,
                                self.graph.runner.fence)
        if self.graph_resizes:  # already the batch: copy it out of DALI's reused buffer
            import torch

            array = np.asarray(out.as_tensor())  # a view of DALI's buffer
            dtype = torch.float32 if self.host_normalizes else torch.uint8
            batch = self.pool.take(array.shape, dtype)
            batch.numpy()[...] = array
            return batch
        decoded: list[Any] = resize.views(out)
        if self.views is not None:  # V windows a sample, in order
            k = self.per_sample
            decoded = [decoded[i:i + k] for i in range(0, len(decoded), k)]
        return self._resized(decoded, item[2])
