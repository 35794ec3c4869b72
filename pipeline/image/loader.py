"""The image loader: shards -> (DALI or streaming reader) -> checks and crop windows ->
DALI decode graph -> resize/flip (CPU: torch, or the graph with resize_on="dali"; GPU: in the
graph) -> `ImageBatch(image, label, keys)`. Without DALI (backend="portable"), PIL decodes
each window in a thread pool and torch resizes (portable.py); the rest is the same.

    from shardflow import image_loader
    with image_loader("shards/train", batch_size=256) as loader:
        for batch in loader:
            ...  # batch.image: uint8 NCHW on the device; batch.label; batch.keys

Two background stages overlap with the consumer: the reader stage (read, check labels and
image headers, choose crop windows) and the decode stage (image/decode.py). Every sample's
window comes from its header before decoding: a random-resized crop drawn from (seed, epoch,
key) when training, the centre crop when evaluating, so memory is bounded by the output size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.errors import DataError, OnError
from shardflow.image import augment, batchops, choose, views
from shardflow.image.config import ImageConfig
from shardflow.image.decode import DecodeStage, ImageStage
from shardflow.image.portable import PortableImageStage
from shardflow.loading import mix, readers, settled, tuning
from shardflow.loading.batch import EncodedBatch
from shardflow.loading.graphstage import GraphLoader
from shardflow.loading.options import Device, check_names
from shardflow.loading.rng import sample_rng
from shardflow.loading.shardlist import Source
from shardflow.samples import headers, jpegscan, masks
from shardflow.samples.checks import (
    IMAGE_EXTS,
    IMAGE_MEMBERS,
    CheckLimits,
    check_image,
    check_label,
    json_of,
    utf8_of,
)
from shardflow.shards.daliindex import parse_index

log = logging.getLogger(__name__)


def image_loader(source: str | Path | Sequence[str] | Source | mix.Mixture, *,
                 batch_size: int, train: bool = True, seed: int = 0, device: Device = "auto",
                 on_error: OnError = "raise", rank: int | None = None,
                 world_size: int | None = None, local_world_size: int = 1,
                 tuning_file: Path | None = None, use_tuning: bool = True,
                 **options: Any) -> ImageLoader | mix.MixedLoader:
    """A resumable loader of image batches from shards (see `ImageConfig` for `options`).

    `source`: a folder with manifest.json, a glob, a brace pattern, a list of URLs, or any
    fsspec URL; a `Source` resolved already (resolve_source; e.g. a held-out part of one);
    or a mixture `[(source, weight), ...]` (pipeline/loading/mix.py; its option
    `epoch_batches`). `rank`/`world_size` default to torch.distributed's when it is initialised;
    `local_world_size`: the ranks on this node (torchrun's LOCAL_WORLD_SIZE), which share its
    cores among their decode threads. Choices left automatic (decode, reader, threads,
    prefetch, resize_on) come from the tuning file of `tools/bench_loader.py --tune` when one
    was measured on this machine (tuning.py), else from the rules of loading/settled.py;
    `loader.settled` records which.
    """
    check_names("image_loader", options, ImageConfig)
    if mix.is_mixture(source) or "epoch_samples" in options:  # by weight; mix.py
        return mix.build_from(image_loader, mix.sources_of(source), {
            "batch_size": batch_size, "train": train, "seed": seed, "device": device,
            "on_error": on_error, "rank": rank, "world_size": world_size,
            "local_world_size": local_world_size, "tuning_file": tuning_file,
            "use_tuning": use_tuning, **options})
    if options.get("views") is not None and options.get("decode", "auto") == "auto":
        options["decode"] = "cpu"  # views resize on the CPU (views.py); a tuning file's
        # decode="gpu" would refuse them, and the views still land on the device
    asked = {"device": device, **options}
    resolved, _ = tuning.source_and_options("image", source, asked, tuning_file, False)
    tuned = choose.settle_backend(resolved, asked, tuning_file, use_tuning)
    rules = settled.thread_rule(local_world_size)
    if (asked.get("augment") or asked.get("batch_augment")) and _lands_on_cpu(device):
        rules["prefetch"] = (AUGMENT_PREFETCH, "the image loader's with augment on a CPU")
    options, record = settled.settle(asked, tuned, tuning_file, rules)
    cfg = ImageConfig(batch_size=batch_size, train=train, seed=seed, on_error=on_error,
                      **options)
    rank, world_size = readers.distributed(rank, world_size)
    loader = ImageLoader(resolved, cfg, rank, world_size)
    loader.settled = record
    return loader


# A CPU loader's prefetch when it runs the user's ops (decode.py's helper threads) and no
# one chose it: its stages then differ more from batch to batch, and a deeper queue between
# them kept the cores busier. Measured on 2 cores, RandAugment + mixup, 6 paired rounds:
# 1.33-1.37x the torchvision-style recipe at 4, 1.16x at the default 2.
AUGMENT_PREFETCH = 4


def _lands_on_cpu(device: str) -> bool:
    import torch

    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


class ImageLoader(GraphLoader):
    """Batches of images on the target device. Build with `image_loader(...)`."""

    kind = "image"
    members = IMAGE_MEMBERS

    def __init__(self, source: Source, cfg: ImageConfig, rank: int, world_size: int
                 ) -> None:
        self.cfg = cfg
        # the readers carry the targets' members too (checked and cut in _check_one)
        self.extras = cfg.extras + tuple(ext for _, ext in cfg.targets)
        self.fields = cfg.fields
        self._own = set(cfg.fields.members) if cfg.fields is not None else set()
        super().__init__(source, cfg, rank, world_size)
        if cfg.labels and self.reader == "dali":  # indexed shards say up front what they hold
            _refuse_unlabelled(self.source)

    def _decode_stage(self) -> ImageStage:
        c = self.cfg
        self.views = views.resolve(c.views, c.size, c.augment, c.batch_augment)
        if c.targets and (self.views is not None or c.batch_augment):
            raise ValueError("targets with views or batch_augment: not built yet (a mask a "
                             "view; cutmix of masks); use targets with augment")
        if self.views is not None and self.decode == "gpu":
            raise ValueError("views are resized on the CPU, each to its size, but decode='gpu' "
                             "resizes in the graph: use decode='cpu' (the batches still land "
                             "on the device)")
        self.batch_ops = batchops.build(
            c.augment, c.batch_augment, seed=c.seed, channels_first=c.layout == "NCHW",
            normalize=(c.mean, c.std) if c.normalize else None, labels=c.labels,
            num_classes=self.num_classes, views=self.views, targets=c.targets)
        if self.backend == "dali":
            stage: ImageStage = DecodeStage(c, self.placement, self.batch_ops)
        elif c.resize_on == "dali":
            raise ValueError("resize_on='dali' resizes in the DALI graph, but this loader runs "
                             "the portable backend (no DALI): use resize_on='torch' or 'auto'")
        else:
            stage = PortableImageStage(c, self.placement, self.batch_ops)
        self._in_graph = len(stage.graph_ops)
        if self.batch_ops is not None:
            log.info("image loader ops: %s", self.describe()["augment"])
        return stage

    def describe(self) -> dict[str, Any]:
        """Where each stage runs: the backend, reader and decode, and each op of augment and
        batch_augment in order (after the loader's crop, resize and flip)."""
        target = "cpu" if self.placement.target == "cpu" else f"cuda:{self.cuda_index}"
        ops = self.batch_ops.describe(target, f"the DALI graph ({self.decode})",
                                      self._in_graph) if self.batch_ops is not None else []
        shown = [{"size": v.size, "crop": repr(v.crop) if v.crop else "the loader's"}
                 for v in self.views] if self.views is not None else None
        return {"backend": self.backend, "reader": self.reader, "decode": self.decode,
                "device": target, "augment": ops, "views": shown}

    # -- the user's ops ---------------------------------------------------------------------

    def _delivered(self, batch: Any, epoch: int) -> Any:
        if self.batch_ops is None or not batchops.after_delivery(self.placement):
            return batch  # none, or run by the decode stage already
        return self.batch_ops(batch, epoch, done=self._in_graph)

    # -- the reader stage ------------------------------------------------------------------

    def _check_one(self, enc: EncodedBatch, i: int, epoch: int) -> tuple[int | None, Any]:
        if self.cfg.labels and enc.labels[i] is None:
            raise DataError("missing-field", "no .cls member (for shards without labels, "
                            "such as captions, pass labels=False)")
        if not len(enc.data[i]):
            raise DataError("missing-field", f"no image member (.{', .'.join(IMAGE_EXTS)}, "
                            "in either case)")
        label = check_label(enc.labels[i] or b"", self.num_classes) if self.cfg.labels \
            else None
        for ext in self.cfg.extras:  # parsed here, so a bad one is raised or skipped by key
            if ext not in self._own:  # a pipeline's fields decode their own members
                enc.extras[ext][i] = parse_extra(ext, enc.extras[ext][i],
                                                 self.cfg.max_extra_bytes)
        data = enc.data[i].tobytes()
        fixed = jpegscan.readable(data)  # one verdict with verify, ShardDataset, both backends
        if fixed is not data:
            data, enc.data[i], enc.flat = fixed, np.frombuffer(fixed, np.uint8), None
        if data[:2] == b"\xff\xd8" and not headers.whole_jpeg(data):
            # Cut short: a window decode that ends above the missing rows would not notice
            # (DALI's; PIL's cut, rows.py, decodes such a file whole), so whether it is
            # refused would hang on the batch and the epoch's window. PIL's full decode
            # refuses it here, every time, with its reason (it refuses a file that lacks
            # only the marker too, as make_shards and verify_shards do).
            check_image(data, CheckLimits(max_pixels=self.cfg.max_pixels))
        header = headers.check_header(data, self.cfg.max_pixels)  # read once a sample
        orientation = header.orientation if self.cfg.exif_orientation else 1
        upright = headers.ImageHeader(header.width, header.height, orientation).upright_size()
        if self.fields is not None:  # after the image's checks: a bad image is a skip
            self.fields.check(enc, i, epoch, upright, label)
        window = self._window(header, orientation, upright, enc.keys[i], epoch)
        if not self.cfg.targets:
            return label, window
        return label, self._with_masks(window, enc, i, (header.width, header.height))

    def _with_masks(self, window: augment.CropParams, enc: EncodedBatch, i: int,
                    size: tuple[int, int]) -> augment.MaskedCrop:
        """The window with each target's mask decoded, checked (a PNG label map of the
        image's stored size: samples/masks.py) and cut to it; DataError names the member."""
        cuts = []
        for name, ext in self.cfg.targets:
            data = enc.extras[ext][i]
            if data is None:
                raise DataError("missing-field", f"no .{ext} member (asked for by targets)")
            enc.extras[ext][i] = None  # the cut is kept; the bytes are not carried on
            read = masks.read_values if name in self.cfg.value_targets else masks.read_mask
            try:
                label_map = read(bytes(data), size)
            except DataError as err:
                raise DataError(err.reason, f".{ext}: {err.detail}") from None
            w = window
            cuts.append(np.ascontiguousarray(label_map[w.y:w.y + w.height, w.x:w.x + w.width]))
        return augment.MaskedCrop(**vars(window), masks=tuple(cuts))

    def _window(self, header: headers.ImageHeader, orientation: int,
                upright: tuple[int, int], key: str, epoch: int) -> Any:
        """The sample's crop, drawn in the upright frame (`upright`: the size with the EXIF
        `orientation` applied, 1 with exif_orientation=False), as the stored-frame window to
        decode and its turns; with views, a tuple of one per view (image/views.py)."""
        width, height = upright
        if self.views is None:
            window = self._crop(key, epoch, width, height)
            return augment.to_stored(window, orientation, header.width, header.height)
        return tuple(augment.to_stored(self._view_crop(view, views.view_key(key, v), epoch,
                                                       width, height),
                                       orientation, header.width, header.height)
                     for v, view in enumerate(self.views))

    def _crop(self, key: str, epoch: int, width: int, height: int) -> augment.CropParams:
        """The loader's own crop (upright frame): centred for evaluation, else random."""
        if not self.cfg.train:
            return augment.center_crop(width, height, self.cfg.crop_fraction)
        return augment.random_resized_crop(sample_rng(self.seed, epoch, key), width, height,
                                           self.cfg.crop_scale, self.cfg.crop_ratio)

    def _view_crop(self, view: views.View, key: str, epoch: int, width: int, height: int
                   ) -> augment.CropParams:
        if view.crop is None:
            return self._crop(key, epoch, width, height)
        x, y, w, h = view.crop.window(sample_rng(self.seed, epoch, key), width, height)
        return augment.CropParams(x, y, w, h, False)


def _refuse_unlabelled(source: Source) -> None:
    """ValueError when no sample of any shard has a `.cls` member, from the .idx files: the
    loader was asked for labels the shards do not hold. Stops at the first labelled shard."""
    for shard in source.shards:
        with open(shard.index_url) as f:
            try:
                samples = parse_index(f.read())
            except ValueError:
                return  # a bad index is reader_dali's to report, naming the shard
        if any(entry[0] == "cls" for sample in samples for entry in sample):
            return
    raise ValueError(f"labels=True, but no sample of the {len(source.shards)} shards of "
                     f"{source.describe()} has a .cls label; pass labels=False to read "
                     "image-only or caption shards (batch.label is then None)")


_TEXT_EXTS = ("txt", "text", "transcript")  # as webdataset's decoders read them
_JSON_EXTS = ("json", "jsn")


def parse_extra(ext: str, data: bytes | None, max_bytes: int) -> Any:
    """An extra member as the batch carries it: text as str (strict UTF-8, no NUL), JSON
    parsed (json.loads only: data is never evaluated), anything else as bytes."""
    if data is None:
        raise DataError("missing-field", f"no .{ext} member (asked for by extras)")
    if len(data) > max_bytes:
        raise DataError("extra-too-large", f".{ext} member has {len(data)} bytes, more than "
                        f"max_extra_bytes={max_bytes}")
    last = ext.rsplit(".", 1)[-1].lower()
    if last not in _TEXT_EXTS + _JSON_EXTS:
        return bytes(data)
    try:
        return utf8_of(data) if last in _TEXT_EXTS else json_of(data)
    except DataError as err:
        raise DataError(err.reason, f".{ext} member: {err.detail}") from None
