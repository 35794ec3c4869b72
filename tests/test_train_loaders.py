"""`shardflow train` builds its loaders through the public factories: for each task, the
loaders built from train.py's flags (parsed, then TaskOptions -> split_eval -> build_task, as
tools/train.py does) have the same config, field by field, as the `*_loader` function called
as a user would with the same arguments, and summary.json's loader settings say what the
built loader holds."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from conftest import run_tool

from shardflow import image_loader, ops, pointcloud_loader, tabular_loader, text_loader
from shardflow.builtin import make_image_folder, make_pointcloud_folder, make_text_corpus
from shardflow.builtin.ctr import make_ctr_dataset
from shardflow.image.loader import AUGMENT_PREFETCH
from shardflow.loading.holdout import KeyHoldout
from shardflow.loading.options import cores
from shardflow.loading.shardlist import resolve_source
from shardflow.loading.tuning import Tuning
from shardflow.tools import train
from shardflow.trainers.wiring import Built, EvalSplit, TaskOptions, build_task, split_eval


def _shards(root: Path, kind: str, src: Path, *flags: object) -> Path:
    run_tool("make_shards", kind, src, root / "shards", "--quiet", *flags, check=True)
    return root / "shards"


@pytest.fixture(scope="module")
def image_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 images of 10 classes in one shard: held out by key hash."""
    root = tmp_path_factory.mktemp("image")
    return _shards(root, "imagefolder", make_image_folder(root / "src", per_class=6, size=32))


@pytest.fixture(scope="module")
def text_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("text")
    return _shards(root, "text", make_text_corpus(root / "docs", docs=60))


@pytest.fixture(scope="module")
def cloud_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("clouds")
    return _shards(root, "pointcloud",
                   make_pointcloud_folder(root / "src", per_class=3, points=128))


@pytest.fixture(scope="module")
def click_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2,000 click-log rows in 8 blocks, 4 a shard: the second shard is held out whole."""
    root = tmp_path_factory.mktemp("ctr")
    return _shards(root, "tabular", make_ctr_dataset(root / "raw", rows=2000), "--preset",
                   "criteo", "--rows-per-block", 250, "--max-count", 4, "--workers", 1)


def _train(*flags: object, local_world: int = 1) -> tuple[Built, EvalSplit]:
    """What `shardflow train FLAGS` builds on one rank of `local_world` on this node."""
    args = train.build_parser().parse_args(["--out", "unused", "--steps", "1",
                                            *map(str, flags)])
    opts = TaskOptions(**{f.name: getattr(args, f.name) for f in fields(TaskOptions)})
    split = split_eval(resolve_source(args.data, storage_options=args.storage_options,
                                      index=args.index), args.eval_data, 1,
                       args.storage_options)
    return build_task(opts, split, 0, 1, local_world), split


def _same_config(ours: Any, theirs: Any) -> None:
    """Field by field, naming the first that differs; ops compare by what they are (repr),
    as two parses of one recipe are equal ops but not the same objects."""
    assert type(ours.cfg) is type(theirs.cfg)
    for f in fields(ours.cfg):
        mine, yours = getattr(ours.cfg, f.name), getattr(theirs.cfg, f.name)
        if f.name in ("augment", "batch_augment") and isinstance(mine, tuple):
            mine, yours = [repr(op) for op in mine], [repr(op) for op in yours]
        assert mine == yours, f"{f.name}: {mine!r} from shardflow train, {yours!r} from " \
                              "the factory"
    assert ours.source == theirs.source and ours.backend == theirs.backend


def _closed(*loaders: Any) -> None:
    for loader in loaders:
        if loader is not None:
            loader.close()


def test_image_augment_and_mixup_on_the_cpu_as_image_loader(image_shard):
    """The drift this guards against: image_loader deepens prefetch (AUGMENT_PREFETCH) for a
    CPU loader that runs the user's ops, and `train --augment` on the CPU kept 2."""
    built, _ = _train("--task", "image", "--data", image_shard, "--device", "cpu",
                      "--batch-size", 8, "--size", 24, "--augment", "rand-m9-n2-mstd0.5",
                      "--mixup", 0.2, "--cutmix", 1.0, "--label-smoothing", 0.1,
                      local_world=2)
    common: dict[str, Any] = {"batch_size": 8, "size": 24, "num_classes": 10,
                              "device": "cpu", "local_world_size": 2}
    user = image_loader(str(image_shard), holdout=KeyHoldout("train", 10),
                        augment=[ops.RandAugment(num_ops=2, magnitude=27.0,
                                                 magnitude_std=1.5)],
                        batch_augment=ops.Mix(0.2, 1.0, classes=10, label_smoothing=0.1),
                        **common)
    held = image_loader(str(image_shard), train=False, holdout=KeyHoldout("eval", 10),
                        **common)
    try:
        _same_config(built.loader, user)
        _same_config(built.evaluation, held)
    finally:
        _closed(built.loader, built.evaluation, user, held)
    assert built.loader.cfg.prefetch == AUGMENT_PREFETCH == 4
    settings = built.loader_settings
    assert (settings["prefetch"], settings["threads"]) == (4, max(1, cores() // 2))
    assert "augment on a CPU" in settings["prefetch_from"]
    assert "local_world_size=2" in settings["threads_from"] and settings["tuned"] == {}


def test_image_tuning_file_and_flags_as_image_loader(image_shard, tmp_path):
    """The tuning file's prefetch beats the augment rule, a flag beats the tuning file, on
    both paths alike; summary.json names each source."""
    path = tmp_path / "tuning.json"
    Tuning("cpu", "stream", 1, 5, 1000.0).save(path)
    built, _ = _train("--task", "image", "--data", image_shard, "--device", "cpu",
                      "--batch-size", 8, "--size", 24, "--augment", "trivial",
                      "--loader-threads", 2, "--tuning-file", path)
    user = image_loader(str(image_shard), batch_size=8, size=24, num_classes=10,
                        device="cpu", holdout=KeyHoldout("train", 10), threads=2,
                        augment=[ops.TrivialAugmentWide()], tuning_file=path)
    try:
        _same_config(built.loader, user)
    finally:
        _closed(built.loader, built.evaluation, user)
    settings = built.loader_settings
    assert (settings["prefetch"], settings["prefetch_from"]) == (5, "the tuning file")
    assert (settings["threads"], settings["threads_from"]) == (2, "--loader-threads")
    assert settings["tuned"] == dict(user.settled.tuned) and "prefetch" in settings["tuned"]
    assert settings["tuning_file"] == str(path)


def test_text_as_text_loader(text_shard):
    built, _ = _train("--task", "text", "--data", text_shard, "--device", "cpu",
                      "--batch-size", 4, "--seq-len", 64, "--objective", "mlm",
                      "--prefetch", 3)
    user = text_loader(str(text_shard), batch_size=4, seq_len=64, objective="mlm",
                       device="cpu", prefetch=3, holdout=KeyHoldout("train", 10))
    try:
        _same_config(built.loader, user)
        assert built.loader.tokenizer.describe() == user.tokenizer.describe()
    finally:
        _closed(built.loader, built.evaluation, user)
    assert built.loader_settings["prefetch_from"] == "--prefetch"
    assert "threads" not in built.loader_settings


def test_pointcloud_as_pointcloud_loader(cloud_shard):
    built, _ = _train("--task", "pointcloud", "--data", cloud_shard, "--device", "cpu",
                      "--batch-size", 4, "--num-points", 64, "--grid", 8, "--model",
                      "voxnet")
    classes = len(resolve_source(cloud_shard).classes or {})
    user = pointcloud_loader(str(cloud_shard), batch_size=4, num_points=64, grid=8,
                             voxels="occupancy", num_classes=classes, device="cpu",
                             holdout=KeyHoldout("train", 10))
    try:
        _same_config(built.loader, user)
    finally:
        _closed(built.loader, built.evaluation, user)
    settings = built.loader_settings
    assert settings["threads"] == cores() and settings["threads_from"] == f"all {cores()} cores"


def test_ctr_on_a_split_source_as_tabular_loader(click_shards):
    """Held out by shard: the factory gets the training part as a resolved Source, and its
    manifest's schema and row counts travel with it."""
    built, split = _train("--task", "ctr", "--data", click_shards, "--device", "cpu",
                          "--batch-size", 64, "--num-buckets", 512)
    assert split.by_key is None and len(split.train.shards) == 1
    user = tabular_loader(split.train, batch_size=64, num_buckets=512, device="cpu")
    held = tabular_loader(split.held, batch_size=64, num_buckets=512, device="cpu",
                          train=False)
    try:
        _same_config(built.loader, user)
        _same_config(built.evaluation, held)
        assert built.loader.info == user.info and built.loader.info.rows == 2000
    finally:
        _closed(built.loader, built.evaluation, user, held)
    manifest = json.loads((click_shards / "manifest.json").read_text())
    assert built.loader.schema.rows == manifest["tabular"]["rows"]


def test_a_resolved_source_passes_through_and_refuses_what_it_already_took(image_shard):
    source = resolve_source(image_shard)
    assert resolve_source(source) is source
    with pytest.raises(ValueError, match="resolved already"):
        resolve_source(source, index=image_shard)
    with pytest.raises(ValueError, match="holdout="):
        image_loader(source, batch_size=4, holdout=10)
