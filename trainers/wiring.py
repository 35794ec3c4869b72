"""What `tools/train.py` builds before training: the held-out split, the loaders and the
task for `--task`, from the command line's options (one field per flag, see TaskOptions).

    split_eval(source, eval_data, world_size)  -> EvalSplit (train, held-out, how it was chosen)
    build_task(opts, split, rank, world, local_world) -> Built (loader, evaluation, task,
                                                        the loaders' threads and prefetch)

Every loader, training and evaluation, is built by its public `*_loader` function, called
with the flags as a user would call it (`loader_options`) and the split's resolved `Source`:
the tuning file, the backend choice and the automatic decode threads and prefetch are the
factory's, and summary.json reads what it settled off the built loader (`loader.settled`).
The trainer itself (loop.py, run.py) knows no modality; this module is where a modality's
loader and task meet.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import fsspec

from shardflow.loading.holdout import KeyHoldout, Side
from shardflow.loading.shardlist import Source, resolve_source, split_ranks
from shardflow.shards.manifest import MANIFEST, LabelStats, load_manifest
from shardflow.urls import redact

log = logging.getLogger(__name__)
HOLD_OUT_EVERY = 10
HOLD_OUT_PERCENT = 100 // HOLD_OUT_EVERY  # by key hash, when there are too few shards
# loaders with decode threads (GraphOptions.threads)
GRAPH_TASKS = ("image", "pointcloud", "pointcloud-seg")
SEG_FLAGS = {"frame_points": "--frame-points", "voxel_size": "--voxel-size",
             "point_range": "--point-range"}


@dataclass(frozen=True)
class TaskOptions:
    """The options that choose the data, the loaders and the model (train.py's flags)."""

    task: str  # "image" | "text" | "pointcloud" | "pointcloud-seg" | "ctr"
    data: str
    eval_data: str | None = None  # ctr: where the held-out data's schema is read from
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
    # pointcloud-seg (trainers/segment_task.py); None: the model's default
    frame_points: int | None = None  # training points per frame; 0: every point
    voxel_size: tuple[float, float, float] | None = None  # metres per cell; bev only
    point_range: tuple[float, ...] | None = None  # (xmin, ymin, zmin, xmax, ymax, zmax) m
    embedding_dim: int = 16  # ctr: the width of every categorical field's embeddings
    num_buckets: int | None = None  # ctr: ids per field; None: the tabular loader's default
    embeddings_on_cpu: bool = False  # ctr: tables in host memory, the network on `device`
    activation_checkpointing: bool = False
    # image: training batches through shardflow.ops (trainers/image_task.py)
    augment: str | None = None  # a recipe name: rand-m9-n2-mstd0.5, trivial
    mixup: float = 0.0  # mixup's alpha; 0: none
    cutmix: float = 0.0  # cutmix's alpha; 0: none
    label_smoothing: float = 0.0
    num_classes: int | None = None  # when the manifest has no class map or label statistics
    pad_token: str | None = None  # text: the padding token of a tokenizer.json without one
    loader_threads: int | None = None  # None: the factory's (tuning file, else cores / ranks)
    prefetch: int | None = None  # None: the factory's (the tuning file, else its default)
    shards_in_flight: int = 2  # the streaming reader's fetches at once per rank
    cache_dir: str | None = None  # the streaming reader's local cache of remote shards
    index: str | None = None  # the folder of `data`'s manifest and .idx files, if not beside
    cache_limit: int = 32 * 2**30
    tuning_file: Path | None = None  # None: tuning.default_path(), when it exists
    use_tuning: bool = True  # False: --no-tuning
    # fsspec's options for the URLs of `data` (endpoint, credentials): never shown or saved
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class EvalSplit:
    """The training and evaluation data, what summary.json says of the split (`how`), and
    `by_key`: the percent of samples held out by key hash when both read the same shards."""

    train: Source
    held: Source
    how: str
    by_key: int | None = None

    def holdout(self, side: Side) -> KeyHoldout | None:
        return KeyHoldout(side, self.by_key) if self.by_key else None


def split_eval(source: Source, eval_data: str | None, world_size: int = 1,
               storage_options: Mapping[str, Any] | None = None) -> EvalSplit:
    """The evaluation data: `eval_data` when given (its URLs opened with `storage_options`),
    else every 10th shard of `source` (sorted by name, at least one), never trained on. With
    too few shards for that (one, or one held out would leave a rank without a shard), 10% of
    the samples by key hash instead: the same samples on every rank and after a resume
    (pipeline/loading/holdout.py)."""
    if eval_data:
        return EvalSplit(source, resolve_source(eval_data, storage_options=storage_options),
                         f"--eval-data {redact(eval_data)}")
    shards = sorted(source.shards, key=lambda s: s.url)
    held = shards[HOLD_OUT_EVERY - 1:: HOLD_OUT_EVERY] or shards[-1:]
    train = tuple(s for s in shards if s not in held)
    if len(train) < max(world_size, 1):
        count = f"{len(shards)} shard{'s' if len(shards) != 1 else ''}"
        why = count if world_size <= 1 else f"{count} for {world_size} ranks"
        return EvalSplit(source, source, f"held out {HOLD_OUT_PERCENT}% of samples by key hash "
                         f"(no --eval-data, {why}), never trained on", HOLD_OUT_PERCENT)
    names = ", ".join(redact(s.url).rsplit("/", 1)[-1] for s in held)
    return EvalSplit(replace(source, shards=train), replace(source, shards=tuple(held)),
                     f"every {HOLD_OUT_EVERY}th shard of --data, never trained on: {names}")


class Built(NamedTuple):
    """What build_task builds; `loader_settings`: the training loader's decode threads and
    prefetch depth, where each came from, and the tuning file's choices it used."""

    loader: Any
    evaluation: Any
    task: Any
    loader_settings: dict[str, Any]


@dataclass(frozen=True)
class _Ranks:
    """Where the loaders read: this rank of `world`, and its evaluation share (None: none)."""

    rank: int
    world: int
    held: Source | None


def build_task(opts: TaskOptions, split: EvalSplit, rank: int, world: int,
               local_world: int = 1) -> Built:
    """The training loader, the evaluation loader (or None) and the task of `opts.task`. Each
    rank evaluates its share of the held-out data (`eval_share`: every held-out sample on
    exactly one rank, so the summed metrics are those of one process evaluating it all); a
    rank left without a shard evaluates nothing (None) and adds nothing to the sums.
    `local_world`: the ranks on this node (torchrun's LOCAL_WORLD_SIZE), which share its
    cores (the factories' `local_world_size`)."""
    builders = {"image": _image, "text": _text, "pointcloud": _pointcloud,
                "pointcloud-seg": _pointcloud_seg, "ctr": _ctr}
    if opts.task not in builders:
        raise ValueError(f"--task {opts.task}: choose one of {', '.join(builders)}")
    _refuse_misplaced(opts)
    if opts.tuning_file is not None and not Path(opts.tuning_file).is_file():
        raise FileNotFoundError(f"--tuning-file {opts.tuning_file}: no such file (write one "
                                "with tools/bench_loader.py --tune, or drop the flag)")
    ranks = _Ranks(rank, world, eval_share(split.held, rank, world))
    loader, evaluation, task = builders[opts.task](opts, split, ranks,
                                                   loader_options(opts, local_world))
    settings = loader_settings(opts, loader)
    log.info("loaders: %s", describe_settings(settings))
    return Built(loader, evaluation, task, settings)


def _pair(factory: Any, split: EvalSplit, ranks: _Ranks, options: dict[str, Any],
          train: dict[str, Any] | None = None, held: dict[str, Any] | None = None
          ) -> tuple[Any, Any]:
    """The training loader and this rank's evaluation loader (None: no share) of `factory`,
    each on its part of the split and its side of a split by key hash; `train` and `held`:
    the options of one of them alone."""
    loader = factory(split.train, train=True, rank=ranks.rank, world_size=ranks.world,
                     holdout=split.holdout("train"), **options, **(train or {}))
    if ranks.held is None:
        return loader, None
    return loader, factory(ranks.held, train=False, rank=0, world_size=1,
                           holdout=split.holdout("eval"), **options, **(held or {}))


def _refuse_misplaced(opts: TaskOptions) -> None:
    """Flags of another task than `opts.task`, refused before anything is read."""
    if opts.loader_threads is not None and opts.task not in GRAPH_TASKS:
        raise ValueError("--loader-threads sets the decode threads of the image and "
                         "pointcloud loaders; the text and tabular loaders read and prepare "
                         "batches in one stage of their own: drop the flag (--prefetch "
                         "applies)")
    if opts.task != "image" and (opts.augment or opts.mixup or opts.cutmix
                                 or opts.label_smoothing):
        raise ValueError("--augment, --mixup, --cutmix and --label-smoothing are for --task "
                         "image")
    given = [flag for name, flag in SEG_FLAGS.items() if getattr(opts, name) is not None]
    if opts.task != "pointcloud-seg" and given:
        raise ValueError(f"{', '.join(given)}: for --task pointcloud-seg; drop "
                         f"{'it' if len(given) == 1 else 'them'} for --task {opts.task}")
    if opts.augment:
        from shardflow.ops import spec

        spec.parse(opts.augment)  # a bad recipe name is refused before anything is read


def eval_share(held: Source, rank: int, world: int) -> Source | None:
    """Rank `rank`'s part of the held-out data, read whole by a one-rank loader: with at
    least `world` shards, balanced by sample count (shardlist.split_ranks, largest shard
    first), else (or with counts unknown) every `world`th shard; None for a rank left
    without one. The parts are disjoint and cover every held-out shard, so no sample is
    evaluated twice or dropped to even out ranks. With a held-out slice by key hash (the
    same shards as training), each rank reads its shards' slice."""
    if world <= 1:
        return held
    # the same order on every rank; a shard known to be empty is no rank's part
    shards = sorted((s for s in held.shards if s.samples != 0), key=lambda s: s.url)
    if len(shards) >= world and all(s.samples is not None for s in shards):
        # the largest first: the greedy split then evens the ranks out best
        mine = split_ranks(sorted(shards, key=lambda s: -(s.samples or 0)), world)[rank]
    else:
        mine = shards[rank::world]
    return replace(held, shards=tuple(mine)) if mine else None


def loader_options(opts: TaskOptions, local_world: int = 1) -> dict[str, Any]:
    """The keyword arguments of an `opts.task` loader that the flags give, for its `*_loader`
    function, as a user would pass them: a flag left automatic (None) is left out, for the
    factory to settle (the tuning file, else its own rule or default)."""
    options: dict[str, Any] = {
        "batch_size": opts.batch_size, "seed": opts.seed, "device": opts.device,
        "decode": opts.decode, "on_error": opts.on_error, "reader": opts.reader,
        "backend": opts.backend, "shards_in_flight": opts.shards_in_flight,
        "cache_dir": opts.cache_dir, "cache_limit": opts.cache_limit,
        "tuning_file": opts.tuning_file, "use_tuning": opts.use_tuning}
    if opts.prefetch is not None:
        options["prefetch"] = opts.prefetch
    if opts.task in GRAPH_TASKS:
        options["local_world_size"] = local_world
        if opts.loader_threads is not None:
            options["threads"] = opts.loader_threads
    return options


def loader_settings(opts: TaskOptions, loader: Any) -> dict[str, Any]:
    """What summary.json says of the training loader: its decode threads and prefetch as
    built, where each came from (the flag; else what its factory recorded, the tuning file
    or a rule of its own; else the loaders' default), and the tuning file's choices used."""
    flags = {"threads": ("--loader-threads", opts.loader_threads),
             "prefetch": ("--prefetch", opts.prefetch)}
    settings: dict[str, Any] = {}
    for name, (flag, given) in flags.items():
        if name == "threads" and opts.task not in GRAPH_TASKS:
            continue  # the text and tabular loaders have no decode threads
        settings[name] = getattr(loader.cfg, name)
        settings[f"{name}_from"] = flag if given is not None else \
            loader.settled.origin(name) or "the loaders' default"
    settings["tuned"] = dict(loader.settled.tuned)
    settings["tuning_file"] = loader.settled.tuning_file
    return settings


def describe_settings(settings: dict[str, Any]) -> str:
    """The loader settings in one line, e.g. "decode threads 4 (--loader-threads), prefetch 2
    (the loaders' default)"."""
    parts = []
    if "threads" in settings:
        parts.append(f"decode threads {settings['threads']} ({settings['threads_from']})")
    parts.append(f"prefetch {settings['prefetch']} ({settings['prefetch_from']})")
    if settings["tuned"]:
        parts.append(f"from the tuning file {settings['tuning_file']}: {settings['tuned']}")
    return ", ".join(parts)


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
    elif (stats := _label_stats(opts.index or opts.data, opts.storage_options)) is not None:
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


def _label_stats(data: str, storage_options: Mapping[str, Any]) -> LabelStats | None:
    """The label statistics of the manifest `data` names (a folder or a .json), if any."""
    base = data.rstrip("/")
    url = base if base.endswith(".json") else f"{base}/{MANIFEST}"
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    return load_manifest(url, storage_options).labels if fs.isfile(path) else None


def _image(opts: TaskOptions, split: EvalSplit, ranks: _Ranks, options: dict[str, Any]
           ) -> tuple[Any, Any, Any]:
    from shardflow import image_loader
    from shardflow.trainers.image_task import ImageClassification

    classes = _classes(opts, split.train)
    augment, batch_augment = _augment(opts, classes)
    loader, evaluation = _pair(image_loader, split, ranks,
                               {**options, "size": opts.size, "num_classes": classes},
                               train={"augment": augment, "batch_augment": batch_augment})
    recipe = None
    if augment or batch_augment or opts.label_smoothing:  # what summary.json's setup shows
        recipe = {"ops": [repr(op) for op in augment],
                  "mix": repr(batch_augment[0]) if batch_augment else None,
                  "label_smoothing": opts.label_smoothing,
                  "runs": sorted({entry["runs"] for entry in loader.describe()["augment"]})}
    task = ImageClassification(classes, opts.model or "small-resnet", device_of(loader),
                               opts.activation_checkpointing, opts.label_smoothing, recipe)
    return loader, evaluation, task


def _augment(opts: TaskOptions, classes: int) -> tuple[list[Any], list[Any]]:
    """--augment and --mixup/--cutmix as the training loader's augment and batch_augment:
    its ops run where the loader runs them (a CPU loader's in its decode stage's helper
    threads, beside the training step; a GPU loader's on the device after delivery), drawn
    from (seed, epoch, key) as every loader's ops are. A mix carries --label-smoothing into
    its soft targets (batch.target); without one the loss smooths the labels itself."""
    from shardflow import ops
    from shardflow.ops import spec

    recipe = spec.parse(opts.augment) if opts.augment else []
    if not (opts.mixup or opts.cutmix):
        return recipe, []
    return recipe, [ops.Mix(opts.mixup, opts.cutmix, classes=classes,
                            label_smoothing=opts.label_smoothing)]


def _text(opts: TaskOptions, split: EvalSplit, ranks: _Ranks, options: dict[str, Any]
          ) -> tuple[Any, Any, Any]:
    from shardflow import text_loader
    from shardflow.trainers.text_task import LanguageModelling

    if opts.model:
        raise ValueError("--model is for image, pointcloud and ctr tasks; text models follow "
                         "--objective (mlm: encoder, clm: decoder)")
    own = {"seq_len": opts.seq_len, "objective": opts.objective, "tokenizer": opts.tokenizer,
           "pad_token": opts.pad_token}
    loader, evaluation = _pair(text_loader, split, ranks, {**options, **own})
    task = LanguageModelling(opts.objective, loader.tokenizer.vocab_size, opts.seq_len,
                             device_of(loader))
    return loader, evaluation, task


def _pointcloud(opts: TaskOptions, split: EvalSplit, ranks: _Ranks, options: dict[str, Any]
                ) -> tuple[Any, Any, Any]:
    from shardflow import pointcloud_loader
    from shardflow.trainers.pointcloud_task import MODELS, PointCloudClassification

    classes, model = _classes(opts, split.train), opts.model or "pointnet"
    if model not in MODELS:  # before any loader is built
        raise ValueError(f"--model {model}: choose one of {', '.join(MODELS)} for point clouds")
    own = {"num_points": opts.num_points, "grid": opts.grid, "num_classes": classes,
           "voxels": "occupancy" if model == "voxnet" else None}
    loader, evaluation = _pair(pointcloud_loader, split, ranks, {**options, **own})
    task = PointCloudClassification(classes, model, device_of(loader), grid=opts.grid)
    return loader, evaluation, task


def _pointcloud_seg(opts: TaskOptions, split: EvalSplit, ranks: _Ranks,
                    options: dict[str, Any]) -> tuple[Any, Any, Any]:
    """LiDAR scans labelled per point: the point-cloud loader with per_point_labels (and the
    voxel grid for bev), every point of a held-out frame evaluated; the classes, the ignored
    label and the class names are the loader's (its manifest's)."""
    model, own, frame_points = _seg_geometry(opts)  # refused before anything is imported
    from shardflow import pointcloud_loader
    from shardflow.trainers.segment_task import PointSegmentation

    loader, evaluation = _pair(pointcloud_loader, split, ranks, {**options, **own},
                               train={"frame_points": frame_points},
                               held={"frame_points": None})
    classes, names = _seg_classes(opts, loader)
    task = PointSegmentation(classes, model, loader.ignore_label, device_of(loader), names,
                             own.get("voxel_size"), own.get("point_range"))
    return loader, evaluation, task


def _seg_geometry(opts: TaskOptions) -> tuple[str, dict[str, Any], int | None]:
    """(model, the loader options of its geometry, training points per frame or None for
    all): bev reads a voxel grid (--voxel-size, default 0.4 m, in --point-range), pointnet
    the points (--frame-points of each training frame, default 20000)."""
    from shardflow.trainers import segment_task as seg

    model = opts.model or "pointnet"
    if model not in seg.MODELS:  # before any loader is built
        raise ValueError(f"--model {model}: choose one of {', '.join(seg.MODELS)} for "
                         "pointcloud-seg")
    if model == "pointnet" and opts.voxel_size is not None:
        raise ValueError("--voxel-size is for --model bev (pointnet reads the points, not a "
                         "voxel grid): drop it, or pass --model bev")
    own: dict[str, Any] = {"per_point_labels": True}
    if model == "bev" or opts.point_range is not None:
        own["point_range"] = tuple(opts.point_range or seg.DEFAULT_RANGE)
    if model == "bev":
        own["voxel_size"] = tuple(opts.voxel_size or (seg.DEFAULT_VOXEL_SIZE,) * 3)
    frames = opts.frame_points
    if frames is None:
        frames = seg.DEFAULT_FRAME_POINTS if model == "pointnet" else 0
    return model, own, frames or None


def _seg_classes(opts: TaskOptions, loader: Any) -> tuple[int, list[str] | None]:
    """The class count (the loader's, from the manifest; --num-classes where it has none,
    or more: classes absent from this data) and their names where there is one per class."""
    known, given = loader.num_classes, opts.num_classes
    if known is None and given is None:
        raise ValueError(f"{redact(opts.data)}: its manifest gives no class count; pass "
                         "--num-classes N (labels 0..N-1, the ignored one included)")
    if known is not None and given is not None and given < known:
        raise ValueError(f"--num-classes {given} is below the {known} classes of "
                         f"{redact(opts.data)}'s manifest: drop the flag or fix its value")
    classes = given or known
    names = loader.class_names
    return classes, list(names) if names and len(names) == classes else None


def _ctr(opts: TaskOptions, split: EvalSplit, ranks: _Ranks, options: dict[str, Any]
         ) -> tuple[Any, Any, Any]:
    """Click logs: the tabular loader hashes each categorical field into its buckets; the
    model's tables are sized by the loader's schema (the same buckets train and evaluate)."""
    from shardflow import tabular_loader
    from shardflow.trainers.ctr_models import MODELS
    from shardflow.trainers.ctr_task import ClickThroughRate

    model = opts.model or "dlrm"
    if model not in MODELS:  # before any loader is built
        raise ValueError(f"--model {model}: choose one of {', '.join(MODELS)} for ctr")
    if opts.embeddings_on_cpu and ranks.world > 1:
        raise ValueError("--embeddings-on-cpu puts the tables and the network on two device "
                         "types, which DDP cannot wrap: drop the flag under torchrun (the "
                         "tables then live on each rank's device)")
    own = {} if opts.num_buckets is None else {"num_buckets": opts.num_buckets}
    loader, evaluation = _pair(tabular_loader, split, ranks, {**options, **own})
    schema = loader.schema
    task = ClickThroughRate(model, len(schema.dense), schema.num_buckets, device_of(loader),
                            opts.embedding_dim, opts.embeddings_on_cpu)
    return loader, evaluation, task
