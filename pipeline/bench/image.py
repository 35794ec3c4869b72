"""The image loader benchmark: ours beside the baselines of BENCHMARKS.md, same bytes, same
work (random-resized-crop to `size`, horizontal flip, uint8 out, batch and thread counts equal).

Each contender is an object whose `epoch()` reads the whole corpus once and returns the number
of images; `pipeline.bench.alternate` runs them A B C... after a warm-up and keeps medians.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.image import augment

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
DALI_DEPTH = 2  # DALI's default prefetch_queue_depth


@dataclass(frozen=True)
class Corpus:
    """The same JPEG bytes twice: an image folder and shards made from it."""

    folder: Path
    shards: Path
    images: int
    batch_size: int
    threads: int
    size: int = 224


# -- ours ----------------------------------------------------------------------------------------

class Ours:
    """Our loader with the benchmark's thread count (not a tuning file's), unless `options`
    say otherwise (--tune tries other configurations)."""

    def __init__(self, c: Corpus, **options: Any) -> None:
        from pipeline.image.loader import image_loader

        options = {"device": "cpu", "threads": c.threads, "use_tuning": False, **options}
        self.loader = image_loader(c.shards, batch_size=c.batch_size, size=c.size, **options)

    def epoch(self) -> int:
        return sum(len(b) for b in self.loader)


# -- DALI by hand, and decode only -------------------------------------------------------------

class DaliByHand:
    """What a user writes with DALI directly: reader, ROI-decoding random crop, resize, flip."""

    def __init__(self, c: Corpus, decode_only: bool = False) -> None:
        from nvidia.dali import fn, pipeline_def, types

        tars = sorted(glob.glob(str(c.shards / "*.tar")))

        @pipeline_def(batch_size=c.batch_size, num_threads=c.threads, device_id=None, seed=1,
                      prefetch_queue_depth=DALI_DEPTH)
        def pipe() -> Any:
            jpg, label = fn.readers.webdataset(
                paths=tars, index_paths=[t[:-4] + ".idx" for t in tars], ext=["jpg;png", "cls"],
                random_shuffle=True, initial_fill=1024, pad_last_batch=True, name="reader")
            if decode_only:
                return fn.decoders.image(jpg, device="cpu", output_type=types.RGB), label
            img = fn.decoders.image_random_crop(jpg, device="cpu", output_type=types.RGB,
                                                random_area=list(SCALE),
                                                random_aspect_ratio=list(RATIO))
            img = fn.resize(img, resize_x=c.size, resize_y=c.size)
            return fn.crop_mirror_normalize(img, mirror=fn.random.coin_flip(),
                                            output_layout="CHW", dtype=types.UINT8), label

        self.pipe = pipe()
        self.pipe.build()
        self.batches = -(-c.images // c.batch_size)
        self.primed = False

    def epoch(self) -> int:
        """One epoch, with DALI's usual two iterations in flight, ending with none: a pipeline
        left running ahead would decode in the background, on the CPU time of whichever
        contender runs next."""
        depth = min(DALI_DEPTH, self.batches)
        for _ in range(1 if not self.primed else depth):
            self.pipe.schedule_run()  # the very first call prefetches `depth` iterations
        self.primed, scheduled, n = True, depth, 0
        for _ in range(self.batches):
            images, _labels = self.pipe.outputs()
            n += len(images)
            if scheduled < self.batches:
                self.pipe.schedule_run()
                scheduled += 1
        return n


# -- torchvision-style and webdataset + PIL ----------------------------------------------------

class _PilTransform:
    """torchvision's RandomResizedCrop + RandomHorizontalFlip on PIL, then uint8 CHW (or the
    float ToTensor + Normalize of the canonical recipe). Used when torchvision is missing."""

    def __init__(self, size: int, normalize: bool) -> None:
        self.size, self.normalize = size, normalize
        self.rng = np.random.default_rng()

    def __call__(self, img: Any) -> Any:
        import random

        import torch
        from PIL import Image

        img = upright(img).convert("RGB")
        w = augment.random_resized_crop(random.Random(), img.width, img.height, SCALE, RATIO)
        img = img.crop((w.x, w.y, w.x + w.width, w.y + w.height))
        img = img.resize((self.size, self.size), Image.Resampling.BILINEAR)
        if w.flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)
        if not self.normalize:
            return out
        mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
        return (out.float() / 255 - mean) / std


def upright(img: Any) -> Any:
    """`img` turned by its EXIF orientation, in place (PIL's exif_transpose). Our loader does
    it by default, so the PIL baselines do the same work and give the same pixels."""
    from PIL import ImageOps

    ImageOps.exif_transpose(img, in_place=True)
    return img


def transform(size: int, normalize: bool) -> tuple[Any, str]:
    """torchvision's transforms when it is installed, else the same work in plain PIL; both
    turn photos upright first (`upright`), as our loader and DALI's decoders do."""
    try:
        from torchvision import transforms as v1
        from torchvision.transforms import v2
    except ImportError:
        return _PilTransform(size, normalize), "PIL re-implementation (no torchvision)"
    if normalize:
        return v1.Compose([upright, v1.RandomResizedCrop(size), v1.RandomHorizontalFlip(),
                           v1.ToTensor(),
                           v1.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]), "v1"
    return v2.Compose([upright, v2.RandomResizedCrop(size), v2.RandomHorizontalFlip(),
                       v2.PILToTensor()]), "v2"


class _Folder:
    """ImageFolder: sorted class folders, PIL loading, a transform."""

    def __init__(self, root: Path, tf: Any) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [(str(f), i) for i, c in enumerate(classes)
                      for f in sorted((root / c).iterdir())]
        self.tf = tf

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        path, label = self.items[i]
        with Image.open(path) as img:
            return self.tf(img), label


class TorchvisionStyle:
    def __init__(self, c: Corpus, normalize: bool = False) -> None:
        import torch

        tf, self.flavour = transform(c.size, normalize)
        try:
            from torchvision.datasets import ImageFolder

            dataset: Any = ImageFolder(str(c.folder), transform=tf)
        except ImportError:
            dataset = _Folder(c.folder, tf)
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=c.batch_size,
                                                  shuffle=True, num_workers=c.threads,
                                                  persistent_workers=True)

    def epoch(self) -> int:
        return sum(len(images) for images, _ in self.loader)


class WebdatasetPil:
    def __init__(self, c: Corpus) -> None:
        import torch
        import webdataset as wds

        tf, _ = transform(c.size, normalize=False)
        urls = sorted(glob.glob(str(c.shards / "*.tar")))
        dataset = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
                   .shuffle(1000).decode("pil").to_tuple("jpg;png", "cls")
                   .map_tuple(tf, lambda x: x))
        self.loader = torch.utils.data.DataLoader(dataset.batched(c.batch_size), batch_size=None,
                                                  num_workers=c.threads,
                                                  persistent_workers=True)

    def epoch(self) -> int:
        return sum(len(images) for images, _ in self.loader)
