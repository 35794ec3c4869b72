"""The image loader: shards -> (DALI or streaming reader) -> checks and crop windows ->
DALI decode graph -> resize/flip (CPU: torch, or the graph with resize_on="dali"; GPU: in the
graph) -> `Batch(image, label, keys)`.

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
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline import augment, image_graph, readers, tuning
from pipeline.batch import EncodedBatch
from pipeline.checks import check_label
from pipeline.errors import DataError, OnError, SkipLog, handle
from pipeline.image_decode import DecodeStage
from pipeline.loader import Loader, Produced
from pipeline.readplan import EpochPlan
from pipeline.shardlist import Source, resolve

log = logging.getLogger(__name__)
Device = Literal["auto", "cpu", "gpu"]
ReaderKind = readers.ReaderKind
IMAGE_EXTS = ("jpg", "png", "jpeg")


@dataclass(frozen=True)
class ImageConfig:
    """Options of `image_loader`; every field is also a keyword argument of it."""

    batch_size: int
    train: bool = True
    seed: int = 0
    device: Device = "auto"
    on_error: OnError = "raise"
    size: int = 224
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    crop_fraction: float = 0.875  # eval: the centre crop's share of the shorter side
    layout: image_graph.Layout = "NCHW"
    normalize: bool = False  # float32 normalized with mean/std instead of uint8
    mean: tuple[float, float, float] = image_graph.IMAGENET_MEAN
    std: tuple[float, float, float] = image_graph.IMAGENET_STD
    num_classes: int | None = None  # labels must be below it (default: the manifest's classes)
    threads: int = field(default_factory=readers.cores)
    prefetch: int = 2
    shuffle_buffer: int = 1024
    reader: ReaderKind = "auto"
    max_pixels: int = 64_000_000
    interp: Literal["linear", "triangular", "cubic"] = "linear"  # the graph's resize filter
    # Where resize, flip and (with normalize) normalization run after a CPU decode: "torch"
    # (resize.py, in the decode stage's thread) or "dali" (the graph, on DALI's CPU threads);
    # "auto": the tuning file's choice, else torch. A GPU loader always resizes in the graph.
    resize_on: Literal["auto", "torch", "dali"] = "auto"
    antialias: bool = True
    fast_idct: bool = False
    hw_decoder_load: float = 0.65
    allow_pipe: bool = False
    timeout_s: float | None = 600.0  # no batch for this long: the loader is hung, raise

    def __post_init__(self) -> None:
        readers.common_checks(self)
        readers.positive(self, "size", "threads", "max_pixels")
        readers.choice(self, "layout", ("NCHW", "NHWC"))
        readers.choice(self, "interp", ("linear", "triangular", "cubic"))
        readers.choice(self, "resize_on", ("auto", "torch", "dali"))
        readers.interval(self, "crop_scale", 0, 1)
        readers.interval(self, "crop_ratio", 0, float("inf"))
        if not 0 < self.crop_fraction <= 1:
            raise ValueError(f"crop_fraction={self.crop_fraction}: a share in (0, 1]")
        if not 0 <= self.hw_decoder_load <= 1:
            raise ValueError(f"hw_decoder_load={self.hw_decoder_load}: a share in [0, 1]")
        if self.num_classes is not None and self.num_classes < 1:
            raise ValueError(f"num_classes={self.num_classes}: must be positive (or None)")


def image_loader(source: str | Path | Sequence[str], *, batch_size: int, train: bool = True,
                 seed: int = 0, device: Device = "auto", on_error: OnError = "raise",
                 rank: int | None = None, world_size: int | None = None,
                 tuning_file: Path | None = None, use_tuning: bool = True,
                 **options: Any) -> ImageLoader:
    """A resumable loader of image batches from shards (see `ImageConfig` for `options`).

    `source`: a folder with manifest.json, a glob, a brace pattern, a list of URLs, or any
    fsspec URL. `rank`/`world_size` default to torch.distributed's when it is initialised.
    Choices left automatic (device, reader, threads, prefetch, resize_on) come from the tuning
    file of
    `tools/bench_loader.py --tune` when one was measured on this machine (see tuning.py).
    """
    if use_tuning:
        options = tuning.apply({"device": device, **options}, tuning_file)
        device = options.pop("device")
    cfg = ImageConfig(batch_size=batch_size, train=train, seed=seed, device=device,
                      on_error=on_error, **options)
    rank, world_size = readers.distributed(rank, world_size)
    return ImageLoader(resolve(source, allow_pipe=cfg.allow_pipe), cfg, rank, world_size)


class ImageLoader(Loader):
    """Batches of images on the target device. Build with `image_loader(...)`."""

    kind = "image"

    def __init__(self, source: Source, cfg: ImageConfig, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.device, self.cuda_index = readers.resolve_device(cfg.device, self.kind)
        self._init_from_config(source, cfg, rank, world_size)
        classes = self.source.classes
        self.num_classes = cfg.num_classes or (len(classes) if classes else None)
        self._decoder = DecodeStage(cfg, self.device, self.cuda_index, self.batch_size)

    # -- the reader stage ------------------------------------------------------------------

    def _encoded(self, plan: EpochPlan, state: dict[str, Any] | None
                 ) -> Iterator[EncodedBatch]:
        return readers.encoded(self.reader, plan, state, self.on_error, IMAGE_EXTS)

    def _prepared(self, plan: EpochPlan, state: dict[str, Any] | None,
                  stop: threading.Event) -> Iterator[tuple[EncodedBatch, list[Any]]]:
        for enc in self._encoded(plan, state):
            if stop.is_set():
                return
            yield enc, self._check_and_place(enc, plan.epoch)

    def _check_and_place(self, enc: EncodedBatch, epoch: int) -> list[Any]:
        """Drop (or raise on) samples with a bad label or image header; crop windows for the
        rest. Returns [labels, windows] aligned with what is left in `enc`."""
        labels, windows, skips = [], [], SkipLog()
        for i in reversed(range(len(enc))):
            try:
                label, window = self._check_one(enc, i, epoch)
            except DataError as err:
                handle(err.located(source=enc.urls[i], key=enc.keys[i]), self.on_error, skips)
                enc.drop(i)
                continue
            labels.append(label)
            windows.append(window)
        enc.skips.extend(reversed(skips.entries))
        return [labels[::-1], windows[::-1]]

    def _check_one(self, enc: EncodedBatch, i: int, epoch: int) -> tuple[int, Any]:
        if enc.labels[i] is None:
            raise DataError("missing-field", "no .cls member")
        if not len(enc.data[i]):
            raise DataError("missing-field", "no .jpg/.png member")
        label = check_label(enc.labels[i] or b"", self.num_classes)
        width, height = augment.check_pixels(enc.data[i].tobytes(), self.cfg.max_pixels)
        if not self.cfg.train:
            return label, augment.center_crop(width, height, self.cfg.crop_fraction)
        rng = augment.sample_rng(self.seed, epoch, enc.keys[i])
        return label, augment.random_resized_crop(rng, width, height, self.cfg.crop_scale,
                                                  self.cfg.crop_ratio)

    # -- the decode stage ------------------------------------------------------------------

    def _produce(self, plan: EpochPlan, reader_state: dict[str, Any] | None,
                 stop: threading.Event) -> Iterator[Produced]:
        return self._two_stages(lambda s: self._prepared(plan, reader_state, s),
                                self._decoder, stop)

    def close(self) -> None:
        super().close()
        self._decoder.close()
