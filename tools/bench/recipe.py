"""The RandAugment + mixup pair of the image benchmark: the same recipe two ways, on the same
bytes: random-resized-crop 224 and flip, RandAugment(2 ops, magnitude 9 of torchvision's 31
bins), then mixup/cutmix (timm's batch mode) on each batch, uint8 out.

    shardflow:          our loader with augment=[RandAugment] and batch_augment=[Mix]: both
                        batched in torch (shardflow.ops), in its decode stage's helper
                        threads
    torchvision-style:  ImageFolder + DataLoader workers; RandAugment per image on PIL
                        (torchvision's own where it imports, else its PIL definitions here);
                        the same mix on each collated batch, as timm's Mixup runs it
"""

from __future__ import annotations

import math
import random
from typing import Any

from shardflow.tools.bench import image as bi

NUM_OPS, MAGNITUDE, BINS = 2, 9, 31


def _mix(classes: int) -> Any:
    from shardflow import ops

    # From the data: `bench --source DIR` benchmarks folders of any number of classes.
    return ops.Mix(0.8, 1.0, classes=classes, label_smoothing=0.1)


class OursRecipe:
    """The loader with the recipe as its own options: RandAugment and the mix run in its
    decode stage's helper threads (image/batchops.py), overlapping the consumer."""

    def __init__(self, c: bi.Corpus) -> None:
        from shardflow import ops

        self.ours = bi.Ours(c, augment=[ops.RandAugment(NUM_OPS, MAGNITUDE, BINS)],
                            batch_augment=[_mix(c.classes)])

    @property
    def loader(self) -> Any:
        return self.ours.loader

    def epoch(self) -> int:
        return self.ours.epoch()


def _pil_op(img: Any, name: str, m: float) -> Any:
    """torchvision's _apply_op on a PIL image (the PIL branch of its functionals)."""
    from PIL import Image, ImageEnhance, ImageOps

    from shardflow.ops.geometry import inverse_affine

    w, h = img.size

    def affine(translate: tuple[float, float], shear: tuple[float, float],
               center: tuple[float, float]) -> Any:
        return img.transform(img.size, Image.Transform.AFFINE,
                             inverse_affine(0.0, translate, 1.0, shear, center),
                             Image.Resampling.NEAREST)
    if name == "ShearX":
        return affine((0, 0), (math.degrees(math.atan(m)), 0.0), (0.0, 0.0))
    if name == "ShearY":
        return affine((0, 0), (0.0, math.degrees(math.atan(m))), (0.0, 0.0))
    if name == "TranslateX":
        return affine((int(m), 0), (0.0, 0.0), (w * 0.5, h * 0.5))
    if name == "TranslateY":
        return affine((0, int(m)), (0.0, 0.0), (w * 0.5, h * 0.5))
    if name == "Rotate":
        return img.rotate(m, Image.Resampling.NEAREST)
    enhance = {"Brightness": ImageEnhance.Brightness, "Color": ImageEnhance.Color,
               "Contrast": ImageEnhance.Contrast, "Sharpness": ImageEnhance.Sharpness}
    if name in enhance:
        return enhance[name](img).enhance(1.0 + m)
    if name == "Posterize":
        return ImageOps.posterize(img, int(m))
    if name == "Solarize":
        return ImageOps.solarize(img, m)  # type: ignore[arg-type]  # a float, as torchvision
    if name == "AutoContrast":
        return ImageOps.autocontrast(img)
    if name == "Equalize":
        return ImageOps.equalize(img)
    return img  # Identity


class PilRandAugment:
    """torchvision's RandAugment on PIL images, its draws included (used where torchvision
    does not import)."""

    def __init__(self) -> None:
        from shardflow.ops.policies import RAND_AUGMENT

        self.space = RAND_AUGMENT

    def __call__(self, img: Any) -> Any:
        for _ in range(NUM_OPS):
            name = random.choice(list(self.space))
            magnitude, signed = self.space[name]
            m = 0.0 if magnitude is None else magnitude(MAGNITUDE, BINS, img.height, img.width)
            img = _pil_op(img, name, -m if signed and random.random() < 0.5 else m)
        return img


def recipe_transform(size: int) -> tuple[Any, str]:
    """crop + flip, RandAugment, then uint8 CHW, per image on PIL: torchvision's transforms
    where it imports, else their PIL definitions (the benchmark's crop, PilRandAugment)."""
    try:
        from torchvision.transforms import v2
    except Exception:  # ImportError, or a broken install (image._torchvision_broken)
        return _PilRecipe(size), "PIL re-implementation"
    return v2.Compose([bi.upright, v2.RandomResizedCrop(size), v2.RandomHorizontalFlip(),
                       v2.RandAugment(NUM_OPS, MAGNITUDE, BINS), v2.PILToTensor()]), "v2"


class _PilRecipe:
    def __init__(self, size: int) -> None:
        self.crop, self.policy = bi._PilTransform(size, normalize=False), PilRandAugment()

    def __call__(self, img: Any) -> Any:
        import numpy as np
        import torch

        out = self.policy(self.crop.pil(img))
        return torch.from_numpy(np.asarray(out).copy()).permute(2, 0, 1)


class TorchvisionRecipe:
    def __init__(self, c: bi.Corpus) -> None:
        import torch

        tf, self.flavour = recipe_transform(c.size)
        dataset: Any = bi._Folder(c.folder, tf)
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=c.batch_size,
                                                  shuffle=True, num_workers=c.threads,
                                                  persistent_workers=True)
        self.mix, self.batches = _mix(c.classes), 0

    def epoch(self) -> int:
        from shardflow import ops

        n = 0
        for images, labels in self.loader:
            self.batches += 1
            images, _, _ = self.mix(images, labels, ops.batch_rng(0, self.batches, []))
            n += len(images)
        return n
