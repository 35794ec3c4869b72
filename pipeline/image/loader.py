"""The image loader: shards -> (DALI or streaming reader) -> checks and crop windows ->
DALI decode graph -> resize/flip (CPU: torch, or the graph with resize_on="dali"; GPU: in the
graph) -> `ImageBatch(image, label, keys)`.

    from pipeline import image_loader
    with image_loader("shards/train", batch_size=256) as loader:
        for batch in loader:
            ...  # batch.image: uint8 NCHW on the device; batch.label; batch.keys

Two background stages overlap with the consumer: the reader stage (read, check labels and
image headers, choose crop windows) and the decode stage (image_decode.py). Every sample's
window comes from its header before decoding: a random-resized crop drawn from (seed, epoch,
key) when training, the centre crop when evaluating, so memory is bounded by the output size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import DataError, OnError
from pipeline.image import augment
from pipeline.image.config import ImageConfig
from pipeline.image.decode import DecodeStage
from pipeline.loading import readers, tuning
from pipeline.loading.batch import EncodedBatch
from pipeline.loading.graphstage import GraphLoader
from pipeline.loading.options import Device
from pipeline.loading.rng import sample_rng
from pipeline.loading.shardlist import Source, resolve_source
from pipeline.samples.checks import IMAGE_EXTS, check_label

log = logging.getLogger(__name__)


def image_loader(source: str | Path | Sequence[str], *, batch_size: int, train: bool = True,
                 seed: int = 0, device: Device = "auto", on_error: OnError = "raise",
                 rank: int | None = None, world_size: int | None = None,
                 tuning_file: Path | None = None, use_tuning: bool = True,
                 **options: Any) -> ImageLoader:
    """A resumable loader of image batches from shards (see `ImageConfig` for `options`).

    `source`: a folder with manifest.json, a glob, a brace pattern, a list of URLs, or any
    fsspec URL. `rank`/`world_size` default to torch.distributed's when it is initialised.
    Choices left automatic (device, reader, threads, prefetch, resize_on) come from the tuning
    file of `tools/bench_loader.py --tune` when one was measured on this machine (tuning.py).
    """
    if use_tuning:
        options = tuning.apply({"device": device, **options}, tuning_file)
        device = options.pop("device")
    cfg = ImageConfig(batch_size=batch_size, train=train, seed=seed, device=device,
                      on_error=on_error, **options)
    rank, world_size = readers.distributed(rank, world_size)
    return ImageLoader(resolve_source(source, allow_pipe=cfg.allow_pipe), cfg, rank,
                       world_size)


class ImageLoader(GraphLoader):
    """Batches of images on the target device. Build with `image_loader(...)`."""

    kind = "image"
    members = IMAGE_EXTS

    def __init__(self, source: Source, cfg: ImageConfig, rank: int, world_size: int
                 ) -> None:
        self.cfg = cfg
        super().__init__(source, cfg, rank, world_size)

    def _decode_stage(self) -> DecodeStage:
        return DecodeStage(self.cfg, self.device, self.cuda_index)

    # -- the reader stage ------------------------------------------------------------------

    def _check_one(self, enc: EncodedBatch, i: int, epoch: int) -> tuple[int, Any]:
        if enc.labels[i] is None:
            raise DataError("missing-field", "no .cls member")
        if not len(enc.data[i]):
            raise DataError("missing-field", "no .jpg/.png member")
        label = check_label(enc.labels[i] or b"", self.num_classes)
        width, height = augment.check_pixels(enc.data[i].tobytes(), self.cfg.max_pixels)
        if not self.cfg.train:
            return label, augment.center_crop(width, height, self.cfg.crop_fraction)
        rng = sample_rng(self.seed, epoch, enc.keys[i])
        return label, augment.random_resized_crop(rng, width, height, self.cfg.crop_scale,
                                                  self.cfg.crop_ratio)
