"""What `tools/train.py` builds before training: the held-out split, the loaders and the
task for `--task`, from the command line's options (one field per flag, see TaskOptions).

    split_eval(source, eval_data)   -> (train source, held-out source, how it was chosen)
    build_task(opts, train, held, rank, world) -> (training loader, eval loader | None, task)

The trainer itself (loop.py, run.py) knows no modality; this module is where a modality's
loader and task meet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import fsspec

from pipeline.loading.shardlist import Source, resolve_source
from pipeline.shards.manifest import MANIFEST, LabelStats, load_manifest
from pipeline.urls import redact

HOLD_OUT_EVERY = 10


@dataclass(frozen=True)
class TaskOptions:
    """The options that choose the data, the loaders and the model (train.py's flags)."""

    task: str  # "image" | "text" | "pointcloud"
    data: str
    batch_size: int = 64
    seed: int = 0
    device: str = "auto"  # where batches land and the model trains
    decode: str = "auto"  # where decoding and augmentation run
    on_error: str = "raise"
    reader: str = "auto"
    backend: str = "auto"  # "dali", "portable" (no DALI) or "auto"
    model: str | None = None
    size: int = 224  # image side after cropping
    objective: str = "clm"
    seq_len: int = 128
    tokenizer: str = "bytes"
    num_points: int = 1024
    grid: int = 24
    activation_checkpointing: bool = False
    num_classes: int | None = None  # when the manifest has no class map or label statistics
    pad_token: str | None = None  # text: the padding token of a tokenizer.json without one


def split_eval(source: Source, eval_data: str | None) -> tuple[Source, Source, str]:
    """The evaluation data: `eval_data` when given, else every 10th shard of `source` (sorted
    by name, at least one), never trained on."""
    if eval_data:
        return source, resolve_source(eval_data), f"--eval-data {redact(eval_data)}"
    shards = sorted(source.shards, key=lambda s: s.url)
    if len(shards) < 2:
        raise ValueError("--data has one shard: nothing to hold out; pass --eval-data or "
                         "re-shard with a smaller --max-count")
    held = shards[HOLD_OUT_EVERY - 1:: HOLD_OUT_EVERY] or shards[-1:]
    train = tuple(s for s in shards if s not in held)
    names = ", ".join(redact(s.url).rsplit("/", 1)[-1] for s in held)
    return (Source(train, source.classes, source.modality),
            Source(tuple(held), source.classes, source.modality),
            f"every {HOLD_OUT_EVERY}th shard of --data, never trained on: {names}")


def build_task(opts: TaskOptions, train: Source, held: Source, rank: int, world: int
               ) -> tuple[Any, Any, Any]:
    """(training loader, evaluation loader or None, task) for `opts.task`. Rank 0 evaluates
    all of the held-out data (often too few shards to split); the other ranks add nothing to
    the sums they share."""
    builders = {"image": _image, "text": _text, "pointcloud": _pointcloud}
    if opts.task not in builders:
        raise ValueError(f"--task {opts.task}: choose one of {', '.join(builders)}")
    return builders[opts.task](opts, train, held, rank, world)


def device_of(loader: Any) -> Any:
    """The torch device a loader's batches land on."""
    import torch

    return torch.device(loader.device)


def _classes(opts: TaskOptions, train: Source) -> int:
    """The class count: the class map's size, else the largest label + 1 from the manifest's
    label statistics, else --num-classes. A --num-classes given beside them must agree: equal
    to the class map, at least the largest label + 1 (more: classes absent from this data)."""
    known, where = None, ""
    if train.classes:
        known, where = len(train.classes), f"its class map ({len(train.classes)} classes)"
    elif (stats := _label_stats(opts.data)) is not None:
        known = stats.ranges[-1][1] + 1
        where = f"its label statistics (labels up to {known - 1})"
    given = opts.num_classes
    if given is None:
        if known is None:
            raise ValueError(f"{redact(opts.data)}: its manifest has no class map and no label "
                             f"statistics; pass --num-classes N (labels 0..N-1) for {opts.task} "
                             "training, or convert the shards again with tools/make_shards.py")
        return known
    if known is not None and (given < known or (train.classes and given != known)):
        raise ValueError(f"--num-classes {given} disagrees with {redact(opts.data)}: "
                         f"{where}; drop the flag or fix its value")
    return given


def _label_stats(data: str) -> LabelStats | None:
    """The label statistics of the manifest `data` names (a folder or a .json), if any."""
    base = data.rstrip("/")
    url = base if base.endswith(".json") else f"{base}/{MANIFEST}"
    fs, path = fsspec.core.url_to_fs(url)
    return load_manifest(url).labels if fs.isfile(path) else None


def _shared(opts: TaskOptions) -> dict[str, Any]:
    return {"batch_size": opts.batch_size, "seed": opts.seed, "device": opts.device,
            "decode": opts.decode, "on_error": opts.on_error, "reader": opts.reader,
            "backend": opts.backend}


def _image(opts: TaskOptions, train: Source, held: Source, rank: int, world: int
           ) -> tuple[Any, Any, Any]:
    from pipeline.image import ImageConfig, ImageLoader
    from trainers.image_task import ImageClassification

    classes = _classes(opts, train)
    common = {**_shared(opts), "size": opts.size, "num_classes": classes}
    loader = ImageLoader(train, ImageConfig(train=True, **common), rank, world)
    evaluation = ImageLoader(held, ImageConfig(train=False, **common), 0, 1) if rank == 0 \
        else None
    task = ImageClassification(classes, opts.model or "small-resnet", device_of(loader),
                               opts.activation_checkpointing)
    return loader, evaluation, task


def _text(opts: TaskOptions, train: Source, held: Source, rank: int, world: int
          ) -> tuple[Any, Any, Any]:
    from pipeline.text import TextConfig, TextLoader
    from pipeline.text.tokenizer import load_tokenizer
    from trainers.text_task import LanguageModelling

    if opts.model:
        raise ValueError("--model is for image and pointcloud tasks; text models follow "
                         "--objective (mlm: encoder, clm: decoder)")
    tokenizer = load_tokenizer(opts.tokenizer, pad_token=opts.pad_token)
    common = {**_shared(opts), "seq_len": opts.seq_len, "objective": opts.objective}
    loader = TextLoader(train, TextConfig(train=True, **common), tokenizer, rank, world)
    evaluation = TextLoader(held, TextConfig(train=False, **common), tokenizer, 0, 1) \
        if rank == 0 else None
    task = LanguageModelling(opts.objective, tokenizer.vocab_size, opts.seq_len,
                             device_of(loader))
    return loader, evaluation, task


def _pointcloud(opts: TaskOptions, train: Source, held: Source, rank: int, world: int
                ) -> tuple[Any, Any, Any]:
    from pipeline.pointcloud import PointCloudConfig, PointCloudLoader
    from trainers.pointcloud_task import MODELS, PointCloudClassification

    classes, model = _classes(opts, train), opts.model or "pointnet"
    if model not in MODELS:  # before any loader is built
        raise ValueError(f"--model {model}: choose one of {', '.join(MODELS)} for point clouds")
    common = {**_shared(opts), "num_points": opts.num_points, "grid": opts.grid,
              "num_classes": classes, "voxels": "occupancy" if model == "voxnet" else None}
    loader = PointCloudLoader(train, PointCloudConfig(train=True, **common), rank, world)
    evaluation = PointCloudLoader(held, PointCloudConfig(train=False, **common), 0, 1) \
        if rank == 0 else None
    task = PointCloudClassification(classes, model, device_of(loader), grid=opts.grid)
    return loader, evaluation, task
