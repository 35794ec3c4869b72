"""The image loader: shards -> (DALI or streaming reader) -> checks and crop windows ->
DALI decode-and-augment graph -> device copy -> `Batch(image, label, keys)`.

    from pipeline import image_loader
    with image_loader("shards/train", batch_size=256) as loader:
        for batch in loader:
            ...  # batch.image: uint8 NCHW on the device; batch.label; batch.keys

Two background stages overlap with the consumer: the reader stage (read, check labels and
image headers, draw crop windows) and the decode stage (DALI graph, copy to the device).
A DALI decode failure is traced to its sample(s) by decoding each one with PIL; under
`on_error="skip"` they are dropped and counted and the batch is decoded again without them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipeline import augment, image_graph, reader_dali, reader_stream, resize
from pipeline.batch import Batch, EncodedBatch
from pipeline.checks import CheckLimits, check_image, check_label
from pipeline.errors import DataError, OnError, check_on_error, handle
from pipeline.loader import Loader, Produced
from pipeline.prefetch import DeviceCopier, Stage
from pipeline.readplan import EpochPlan
from pipeline.shardlist import ShardSpec, Source, resolve
from pipeline.urls import is_remote

log = logging.getLogger(__name__)
Device = Literal["auto", "cpu", "gpu"]
ReaderKind = Literal["auto", "dali", "stream"]


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
    layout: image_graph.Layout = "NCHW"
    normalize: bool = False  # float32 normalized with mean/std instead of uint8
    mean: tuple[float, float, float] = image_graph.IMAGENET_MEAN
    std: tuple[float, float, float] = image_graph.IMAGENET_STD
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    prefetch: int = 2
    shuffle_buffer: int = 1024
    reader: ReaderKind = "auto"
    max_pixels: int = 64_000_000
    interp: Literal["linear", "triangular", "cubic"] = "linear"
    antialias: bool = True
    fast_idct: bool = False
    hw_decoder_load: float = 0.65
    allow_pipe: bool = False

    def __post_init__(self) -> None:
        _positive(self, "batch_size", "size", "threads", "prefetch", "max_pixels")
        check_on_error(self.on_error)
        _choice(self, "device", ("auto", "cpu", "gpu"))
        _choice(self, "reader", ("auto", "dali", "stream"))
        _choice(self, "layout", ("NCHW", "NHWC"))
        _choice(self, "interp", ("linear", "triangular", "cubic"))
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer={self.shuffle_buffer}: use 0 for no shuffling")
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale={self.crop_scale}: need 0 < low <= high <= 1")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise ValueError(f"crop_ratio={self.crop_ratio}: need 0 < low <= high")
        if not 0 <= self.hw_decoder_load <= 1:
            raise ValueError(f"hw_decoder_load={self.hw_decoder_load}: a share in [0, 1]")


def _positive(cfg: object, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")


def _choice(cfg: object, name: str, choices: tuple[str, ...]) -> None:
    if getattr(cfg, name) not in choices:
        raise ValueError(f"{name}={getattr(cfg, name)!r}: choose one of {', '.join(choices)}")


def image_loader(source: str | Path | Sequence[str], *, batch_size: int, train: bool = True,
                 seed: int = 0, device: Device = "auto", on_error: OnError = "raise",
                 rank: int | None = None, world_size: int | None = None,
                 **options: Any) -> ImageLoader:
    """A resumable loader of image batches from shards (see `ImageConfig` for `options`).

    `source`: a folder with manifest.json, a glob, a brace pattern, a list of URLs, or any
    fsspec URL. `rank`/`world_size` default to torch.distributed's when it is initialised.
    """
    cfg = ImageConfig(batch_size=batch_size, train=train, seed=seed, device=device,
                      on_error=on_error, **options)
    rank, world_size = _distributed(rank, world_size)
    return ImageLoader(resolve(source, allow_pipe=cfg.allow_pipe), cfg, rank, world_size)


def _distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None and world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: pass both, with "
                         "0 <= rank < world_size")
    return rank, world_size


def resolve_device(device: Device) -> Literal["cpu", "gpu"]:
    import torch

    if device == "gpu" and not torch.cuda.is_available():
        raise ValueError("device='gpu' but CUDA is not available here; use device='cpu' or "
                         "'auto'")
    chosen: Literal["cpu", "gpu"] = "gpu" if device == "gpu" or (
        device == "auto" and torch.cuda.is_available()) else "cpu"
    log.info("image loader: decode and augment on %s (device=%r)", chosen, device)
    return chosen


class ImageLoader(Loader):
    """Batches of images on the target device. Build with `image_loader(...)`."""

    kind = "image"

    def __init__(self, source: Source, cfg: ImageConfig, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        reader = _pick_reader(source, cfg.reader)
        super().__init__(source, batch_size=cfg.batch_size, seed=cfg.seed, rank=rank,
                         world_size=world_size, shuffle=cfg.train,
                         shuffle_buffer=cfg.shuffle_buffer, on_error=cfg.on_error,
                         prefetch=cfg.prefetch, reader=reader)
        if reader == "dali":
            self.source = self._check_local_shards(source)
        self.num_classes = len(source.classes) if source.classes else None
        self._graph_runner: image_graph.GraphRunner | None = None
        self._copier: DeviceCopier | None = None

    def _check_local_shards(self, source: Source) -> Source:
        good = []
        for shard in source.shards:
            try:
                reader_dali.check_local_shard(shard.url)
                good.append(shard)
            except DataError as err:
                handle(err, self.on_error, self.skips)
        return Source(tuple(good), source.classes, source.modality)

    # -- the reader stage ------------------------------------------------------------------

    def _encoded(self, plan: EpochPlan, state: dict[str, Any] | None
                 ) -> Iterator[EncodedBatch]:
        if self.reader == "dali":
            return reader_dali.batches(plan, state)
        return reader_stream.batches(plan, state, self.on_error, self.skips)

    def _prepared(self, plan: EpochPlan, state: dict[str, Any] | None,
                  stop: threading.Event) -> Iterator[tuple[EncodedBatch, list[Any]]]:
        for enc in self._encoded(plan, state):
            if stop.is_set():
                return
            yield enc, self._check_and_place(enc, plan.epoch)

    def _check_and_place(self, enc: EncodedBatch, epoch: int) -> list[Any]:
        """Drop (or raise on) samples with a bad label or image header; crop windows for the
        rest. Returns [labels, windows] aligned with what is left in `enc`."""
        labels, windows = [], []
        for i in reversed(range(len(enc))):
            try:
                label, window = self._check_one(enc, i, epoch)
            except DataError as err:
                handle(err.located(source=enc.urls[i], key=enc.keys[i]), self.on_error,
                       self.skips)
                enc.drop(i)
                continue
            labels.append(label)
            windows.append(window)
        return [labels[::-1], windows[::-1]]

    def _check_one(self, enc: EncodedBatch, i: int, epoch: int) -> tuple[int, Any]:
        if enc.labels[i] is None:
            raise DataError("missing-field", "no .cls member")
        if not len(enc.data[i]):
            raise DataError("missing-field", "no .jpg/.png member")
        label = check_label(enc.labels[i] or b"", self.num_classes)
        width, height = augment.check_pixels(enc.data[i].tobytes(), self.cfg.max_pixels)
        if not self.cfg.train:
            return label, None
        rng = augment.sample_rng(self.seed, epoch, enc.keys[i])
        return label, augment.random_resized_crop(rng, width, height, self.cfg.crop_scale,
                                                  self.cfg.crop_ratio)

    # -- the decode stage ------------------------------------------------------------------

    def _produce(self, plan: EpochPlan, reader_state: dict[str, Any] | None,
                 stop: threading.Event) -> Iterator[Produced]:
        if self.device == "cpu":
            resize.one_core_in_this_thread()  # this stage thread resizes (see resize.py)
        prepared = Stage(lambda s: self._prepared(plan, reader_state, s), depth=self.prefetch,
                         name="shardflow-image-reader")
        try:
            for (enc, (labels, _)), images in self._runner.run(prepared, self._on_failure):
                if stop.is_set():
                    return
                yield self._to_device(enc, labels, self._empty() if images is None else images)
        finally:
            prepared.close()

    def _on_failure(self, item: tuple[EncodedBatch, list[Any]], exc: Exception
                    ) -> tuple[EncodedBatch, list[Any]]:
        """A batch failed to decode: find the samples PIL cannot decode (each raised or
        skipped); re-raise if there is none, since then the failure is not the data's."""
        enc, (labels, windows) = item
        bad = self._undecodable(enc)
        if not bad:
            raise exc
        for i in reversed(bad):
            for column in (enc.keys, enc.urls, enc.data, enc.labels, labels, windows):
                del column[i]
        return enc, [labels, windows]

    def _undecodable(self, enc: EncodedBatch) -> list[int]:
        """Indices of the samples PIL cannot fully decode; each one is raised or recorded."""
        bad = []
        for i in range(len(enc)):
            try:
                check_image(enc.data[i].tobytes(), CheckLimits(max_pixels=self.cfg.max_pixels))
            except DataError as err:
                bad.append(i)
                handle(err.located(source=enc.urls[i], key=enc.keys[i]), self.on_error,
                       self.skips)
        return bad

    @property
    def _runner(self) -> image_graph.GraphRunner:
        if self._graph_runner is None:
            self._graph_runner = image_graph.GraphRunner(
                self._build_graph, self._feed, self._fetch, lambda item: not len(item[0]),
                depth=2)
        return self._graph_runner

    def _build_graph(self, depth: int) -> Any:
        return image_graph.build(self._spec(), batch_size=self.batch_size,
                                 num_threads=self.cfg.threads, device_id=self._device_id(),
                                 seed=self.seed, prefetch_depth=depth)

    def _feed(self, graph: Any, item: tuple[EncodedBatch, list[Any]]) -> None:
        enc, (_labels, windows) = item
        graph.feed_input("encoded", enc.data)
        if self.cfg.train:
            graph.feed_input("anchor", [np.array([w.x, w.y], np.int32) for w in windows])
            graph.feed_input("shape", [np.array([w.width, w.height], np.int32) for w in windows])
            if self.device == "gpu":  # the graph flips; on the CPU resize.py does
                graph.feed_input("flip", [np.array(int(w.flip), np.int32) for w in windows])

    def _fetch(self, out: Any, item: tuple[EncodedBatch, list[Any]]) -> Any:
        """The graph's output as a host batch: resized here on the CPU (see resize.py)."""
        if self.device == "gpu":
            return _to_numpy(out)
        windows, c = item[1][1], self.cfg
        if c.train:
            return resize.train_batch(resize.views(out), [w.flip for w in windows], c.size,
                                      c.layout == "NCHW")
        return resize.eval_batch(resize.views(out), c.size, 0.875, c.layout == "NCHW")

    def _spec(self) -> image_graph.GraphSpec:
        c = self.cfg
        # On a GPU the graph does it all; on the CPU it decodes and torch resizes (resize.py).
        return image_graph.GraphSpec(
            train=c.train, size=c.size, device=self.device, layout=c.layout, normalize=False,
            interp=c.interp, antialias=c.antialias, fast_idct=c.fast_idct,
            resize=self.device == "gpu", hw_decoder_load=c.hw_decoder_load,
            mean=c.mean, std=c.std)

    def _device_id(self) -> int | None:
        if self.device == "cpu":
            return None
        import torch

        return torch.cuda.current_device()

    def _empty(self) -> np.ndarray:
        c = self.cfg
        shape = (0, 3, c.size, c.size) if c.layout == "NCHW" else (0, c.size, c.size, 3)
        return np.zeros(shape, np.uint8)

    def _to_device(self, enc: EncodedBatch, labels: list[int], images: Any) -> Produced:
        import torch

        if self._copier is None:
            norm = self.cfg.normalize
            self._copier = DeviceCopier(
                "cuda" if self.device == "gpu" else "cpu", self.cfg.mean if norm else None,
                self.cfg.std if norm else None, self.cfg.layout == "NCHW")
        host = self._copier.pinned(images)
        label = torch.tensor(labels, dtype=torch.int64)
        image, label, ready = self._copier(host, label)
        return Batch(image=image, label=label, keys=list(enc.keys)), enc.state, ready

    def close(self) -> None:
        super().close()
        self._graph_runner = None


def _to_numpy(out: Any) -> np.ndarray:
    """A DALI TensorList as one numpy array (GPU outputs are first brought to the host)."""
    if hasattr(out, "as_cpu"):
        out = out.as_cpu()
    return np.array(out.as_tensor())


def _pick_reader(source: Source, reader: ReaderKind) -> str:
    """DALI's reader for local shards that all have .idx files, else the streaming reader."""
    local = all(not is_remote(s.url) and s.url.endswith(".tar") and _has_index(s)
                for s in source.shards)
    if reader == "dali" and not local:
        raise ValueError("reader='dali' needs local .tar shards with .idx files beside them; "
                         "use reader='stream' (or 'auto') for remote or unindexed shards")
    chosen = reader if reader != "auto" else ("dali" if local else "stream")
    log.info("image loader: %s reader for %s", chosen, source.describe())
    return chosen


def _has_index(shard: ShardSpec) -> bool:
    return os.path.exists(shard.url[: -len(".tar")] + ".idx")
