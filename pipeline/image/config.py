"""The image loader's options: the shared loader options plus what images need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shardflow.image.graph import IMAGENET_MEAN, IMAGENET_STD, Layout
from shardflow.loading.options import GraphOptions, choice, interval, positive
from shardflow.samples.checks import IMAGE_EXTS, PICKLE_EXTS


@dataclass(frozen=True)
class ImageConfig(GraphOptions):
    """Options of `image_loader`; every field is also a keyword argument of it, e.g.
    `image_loader(src, batch_size=256, size=160, normalize=True, layout="NHWC")`."""

    size: int = 224
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    crop_fraction: float = 0.875  # eval: the centre crop's share of the shorter side
    layout: Layout = "NCHW"
    normalize: bool = False  # float32 normalized with mean/std instead of uint8
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    max_pixels: int = 64_000_000
    interp: Literal["linear", "triangular", "cubic"] = "linear"  # the graph's resize filter
    # Where resize, flip and (with normalize) normalization run after a CPU decode: "torch"
    # (resize.py, in the decode stage's thread) or "dali" (the graph, on DALI's CPU threads);
    # "auto": the tuning file's choice, else torch. A GPU loader always resizes in the graph.
    resize_on: Literal["auto", "torch", "dali"] = "auto"
    antialias: bool = True
    fast_idct: bool = False
    hw_decoder_load: float = 0.65
    # Turn photos upright by their EXIF orientation tag (JPEG APP1, PNG eXIf); False: the
    # pixels as stored, the tag ignored.
    exif_orientation: bool = True
    # False: image-only shards (no .cls, e.g. captions); every batch.label is None.
    labels: bool = True
    # Other members passed through to batch.extras by extension, e.g. ("txt", "json"):
    # txt/text -> str (UTF-8 checked), json -> json.loads' object, anything else -> bytes.
    extras: tuple[str, ...] = ()
    max_extra_bytes: int = 1 << 20  # per extra member: larger is a data error
    # shardflow.ops ops run over each batch after the crop, resize and flip, drawn per sample
    # from (seed, epoch, key); batch_augment: one ops.Mix (mixup/cutmix) -> batch.target.
    # Normalization (normalize=True) comes after them (image/batchops.py).
    augment: tuple[Any, ...] = ()
    batch_augment: tuple[Any, ...] = ()
    # Several views of each sample (image/views.py): a number of views of this recipe, or a
    # list of op lists, each maybe led by its window op (ops.RandomResizedCrop, CenterCrop).
    views: Any = None
    # Spatial targets read beside the image, by name: {"mask": "seg.png"} gives
    # batch.targets["mask"], (N, size, size), warped as the image is (samples/masks.py).
    targets: Any = None
    # A pipeline's fields and per-sample Python (compose/samples.SampleStage), set by
    # shardflow.Pipeline: its members are among `extras`, decoded by it instead.
    fields: Any = None
    # Targets that hold continuous values (depth, normals), not labels: read as float32
    # (samples/masks.read_values), resized and warped bilinearly; by name.
    value_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "size", "max_pixels")
        choice(self, "layout", ("NCHW", "NHWC"))
        choice(self, "interp", ("linear", "triangular", "cubic"))
        choice(self, "resize_on", ("auto", "torch", "dali"))
        interval(self, "crop_scale", 0, 1)
        interval(self, "crop_ratio", 0, float("inf"))
        if not 0 < self.crop_fraction <= 1:
            raise ValueError(f"crop_fraction={self.crop_fraction}: a share in (0, 1]")
        if not 0 <= self.hw_decoder_load <= 1:
            raise ValueError(f"hw_decoder_load={self.hw_decoder_load}: a share in [0, 1]")
        positive(self, "max_extra_bytes")
        check_extras(self.extras)
        object.__setattr__(self, "extras", tuple(self.extras))  # a list is taken too
        object.__setattr__(self, "targets", check_targets(self.targets, self.extras))
        object.__setattr__(self, "value_targets", tuple(self.value_targets))
        unknown = set(self.value_targets) - {name for name, _ in self.targets}
        if unknown:
            raise ValueError(f"value_targets={self.value_targets!r}: {sorted(unknown)} not among "
                             "the targets' names")
        for name in ("augment", "batch_augment"):
            value = getattr(self, name)
            if value is None:  # no ops, as a list of none
                value = ()
            elif not isinstance(value, (tuple, list)):  # one op alone is taken too
                value = (value,)
            object.__setattr__(self, name, tuple(value))


def check_targets(targets: object, extras: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """{name: member extension} as ((name, ext), ...); () for None."""
    if targets is None:
        return ()
    if isinstance(targets, tuple):  # already checked (a config copied)
        targets = dict(targets)
    if not isinstance(targets, dict) or not targets or not all(
            isinstance(k, str) and k and isinstance(v, str) and v.strip(".")
            for k, v in targets.items()):
        raise ValueError(f"targets={targets!r}: a dict of name -> member extension, e.g. "
                         "{'mask': 'seg.png'}")
    if len(set(targets.values())) != len(targets):
        raise ValueError(f"targets={targets!r}: a member is named twice")
    for name, ext in targets.items():
        if ext in extras or ext.rsplit(".", 1)[-1].lower() == "cls" or \
                ext.lower() in IMAGE_EXTS:
            raise ValueError(f"targets={targets!r}: .{ext} ({name}) is the image, the label "
                             "or an extra; a mask is a member of its own, e.g. seg.png")
    return tuple(targets.items())


def check_extras(extras: object) -> None:
    """Extensions to pass through: strings, once each, none the loader reads otherwise."""
    if isinstance(extras, str) or not isinstance(extras, (tuple, list)) or \
            not all(isinstance(e, str) and e.strip(".") for e in extras):
        raise ValueError(f"extras={extras!r}: a tuple of member extensions, e.g. "
                         "('txt', 'json')")
    for ext in extras:
        last = ext.rsplit(".", 1)[-1].lower()
        if last in IMAGE_EXTS or last == "cls":
            raise ValueError(f"extras={extras!r}: .{ext} is read by the loader itself (the "
                             "image, or the label with labels=True); leave it out")
        if last in PICKLE_EXTS:
            raise ValueError(f"extras={extras!r}: .{ext} is a pickle; shardflow never passes "
                             "pickles on")
    if len(set(extras)) != len(extras):
        raise ValueError(f"extras={extras!r}: an extension is named twice")
