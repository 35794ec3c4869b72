"""The API as users of torchvision, timm and webdataset write it: their habits work, or are
refused with a message that shows what does."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import run_tool

import shardflow
from shardflow import image_loader, ops, text_loader
from shardflow.builtin import make_image_folder


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("habits")
    src = make_image_folder(root / "src", per_class=2, size=40)  # 10 classes
    run_tool("make_shards", "imagefolder", src, root / "shards", "--max-count", 10,
             "--shuffle-seed", 0, "--quiet", check=True)
    return root / "shards"


def loader(shards, **options):
    return image_loader(shards, batch_size=4, size=32, use_tuning=False, threads=1,
                        **options)


def test_a_misspelt_option_names_the_function_and_the_name_meant(shards):
    with pytest.raises(TypeError, match=r"image_loader\(\) got an unexpected keyword argument "
                                        r"'crop_sacle'; did you mean 'crop_scale'"):
        loader(shards, crop_sacle=(0.5, 1.0))
    with pytest.raises(TypeError, match="'interpolation'; did you mean 'interp'"):
        loader(shards, interpolation="bicubic")
    with pytest.raises(TypeError, match=r"text_loader\(\) .*'seqlen'"):
        text_loader(shards, batch_size=2, seqlen=16)


def test_dir_and_star_import_list_the_loaders():
    names = dir(shardflow)
    assert {"image_loader", "text_loader", "pointcloud_loader", "tabular_loader",
            "Pipeline", "ShardDataset"} <= set(names)
    scope: dict = {}
    exec("from shardflow import *", scope)  # noqa: S102 - the habit under test
    assert callable(scope["image_loader"]) and scope["ops"] is ops


def test_a_batch_unpacks_as_images_and_labels(shards):
    with loader(shards, train=False) as it:
        batch = next(iter(it))
        images, labels = batch
    assert images is batch.image and labels is batch.label and images.shape[0] == 4
    with loader(shards, batch_augment=[ops.MixUp(0.8)]) as it:  # soft targets instead
        batch = next(iter(it))
        _, targets = batch
    assert targets.shape == (4, 10) and torch.allclose(targets.sum(1), torch.ones(4))


def test_mixup_takes_the_class_count_from_the_manifest(shards):
    mix = ops.MixUp(0.8)
    with loader(shards, batch_augment=[mix]) as it:
        assert next(iter(it)).target.shape == (4, 10)
    assert mix.classes is None  # the user's op is left as given
    with pytest.raises(ValueError, match="give classes=N"):
        mix(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([0, 1]), random.Random(0))


def test_torchvisions_range_forms_are_taken_and_others_refused():
    rng = random.Random(0)
    angles = [ops.Affine(degrees=(-25, 25)).draw(rng)[0] for _ in range(200)]
    assert -25 <= min(angles) < -15 and 15 < max(angles) <= 25
    assert all(5 <= ops.Rotate(degrees=(5, 10)).draw(rng) <= 10 for _ in range(50))
    factors = [ops.ColorJitter(brightness=(0.6, 1.4)).draw(rng)[1][0] for _ in range(200)]
    assert 0.6 <= min(factors) < 0.7 and 1.3 < max(factors) <= 1.4
    assert all(0.6 <= ops.ColorJitter(brightness=0.4).draw(rng)[1][0] <= 1.4
               for _ in range(50))  # a number x: 1 - x .. 1 + x, as before
    for bad in (lambda: ops.Affine(degrees=(25, -25)), lambda: ops.Rotate(degrees="10"),
                lambda: ops.ColorJitter(contrast=(0.5, 1.0, 1.5))):
        with pytest.raises(ValueError, match=r"a number x >= 0 .* or a \(min, max\) pair"):
            bad()


def test_normalize_takes_torchvisions_units():
    """ToTensor then Normalize(mean, std) with ImageNet's 0..1 values, from the definition."""
    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    want = (images.numpy() / 255.0 - np.array(mean)[None, :, None, None]) \
        / np.array(std)[None, :, None, None]
    got = ops.Normalize(mean=mean, std=std).torch(images, [True, True])
    assert np.allclose(got.numpy(), want, atol=1e-5)
    levels = ops.Normalize(mean=[m * 255 for m in mean], std=[s * 255 for s in std])
    assert torch.allclose(levels.torch(images, [True, True]), got, atol=1e-5)


def test_augment_none_is_no_ops_and_a_crop_op_is_refused_naming_views(shards):
    with loader(shards, train=False, augment=None) as it:
        plain = next(iter(it)).image
    with loader(shards, train=False) as it:
        assert torch.equal(next(iter(it)).image, plain)
    with pytest.raises(ValueError, match="chooses a window.*views="):
        loader(shards, augment=[ops.RandomResizedCrop(32), ops.Flip()])


def test_shuffle_is_apart_from_train(shards):
    def keys(**options):
        with loader(shards, **options) as it:
            return [k for batch in it for k in batch.keys]

    fixed = keys(train=False)
    assert keys(train=True, shuffle=False) == fixed  # augmented, in the fixed order
    assert keys(train=True) != fixed and sorted(keys(train=True)) == sorted(fixed)
    assert keys(train=False, shuffle=True) != fixed


def test_no_progress_bar_is_drawn_into_a_log(tmp_path):
    """Run as a pipeline or CI runs it (stderr no terminal): the summary, and no bar."""
    src = make_image_folder(tmp_path / "src", per_class=1, size=24)
    proc = run_tool("make_shards", "imagefolder", src, tmp_path / "out", check=True)
    assert "10 samples" in proc.stdout
    assert "\r" not in proc.stderr and "%|" not in proc.stderr, proc.stderr


def test_an_empty_class_folder_is_named(tmp_path):
    src = make_image_folder(tmp_path / "src", per_class=1, size=24)
    (src / "zz_empty").mkdir()
    proc = run_tool("make_shards", "imagefolder", src, tmp_path / "out", "--quiet", check=True)
    assert "classes: 11" in proc.stdout
    assert "1 classes hold no sample (zz_empty)" in proc.stdout
