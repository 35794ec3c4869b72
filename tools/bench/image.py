"""The image loader benchmark: ours beside the baselines of BENCHMARKS.md, same bytes, same
work (random-resized-crop to `size`, horizontal flip, uint8 out, batch and thread counts equal).

Each contender is an object whose `epoch()` reads the whole corpus once and returns the number
of images; `bench.core.alternate` runs them A B C... after a warm-up and keeps medians.
"""

from __future__ import annotations

import glob
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.image import augment

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

    @property
    def classes(self) -> int:
        """The folder's class count (its subfolders), which the mixup contenders need."""
        return sum(1 for p in self.folder.iterdir() if p.is_dir())


# -- ours ----------------------------------------------------------------------------------------

class Ours:
    """Our loader with the benchmark's thread count (not a tuning file's), unless `options`
    say otherwise (--tune tries other configurations)."""

    def __init__(self, c: Corpus, whole_rows: bool = False, **options: Any) -> None:
        from shardflow.image.loader import image_loader

        options = {"device": "cpu", "threads": c.threads, "use_tuning": False, **options}
        self.loader = image_loader(c.shards, batch_size=c.batch_size, size=c.size, **options)
        if whole_rows:  # the portable backend as it was: every row of a JPEG decoded
            self.loader._decoder.cut = False  # type: ignore[union-attr]

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
        self.batches, self.images = -(-c.images // c.batch_size), c.images
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
            # pad_last_batch fills the last batch with copies of the last sample: they are
            # decoded (a cost of DALI's epoch-aligned batches, kept), but not images read
            n += min(len(images), self.images - n)
            if scheduled < self.batches:
                self.pipe.schedule_run()
                scheduled += 1
        return n


class WholeEighthDecode:
    """The least a decoder that reads a photo to its end does: every row at the 1/8 DCT scale
    (all of the entropy decoding, next to none of the inverse DCT) with PIL's libjpeg-turbo,
    in `threads` threads; no crop, resize or batch. On large photos the entropy decoding is
    most of the work, and no libjpeg skips it above a window (it does not know where a row's
    bits start without decoding those before them), so this is what a row cut is measured
    against: ours decodes at 1/8 to 1/2 scale, down to the window's last row only."""

    def __init__(self, c: Corpus) -> None:
        self.paths = [path for path, _ in folder_items(c.folder)]
        self.threads = c.threads

    def epoch(self) -> int:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.threads) as pool:  # PIL's decode releases the GIL
            return sum(pool.map(_decode_eighth, self.paths))


def _decode_eighth(path: Path) -> int:
    from PIL import Image

    with Image.open(io.BytesIO(path.read_bytes())) as img:
        img.draft("RGB", (img.width // 8, img.height // 8))
        img.load()
    return 1


# -- torchvision-style and webdataset + PIL ----------------------------------------------------

class _PilTransform:
    """torchvision's RandomResizedCrop + RandomHorizontalFlip on PIL, then uint8 CHW (or the
    float ToTensor + Normalize of the canonical recipe). Used when torchvision is missing."""

    def __init__(self, size: int, normalize: bool) -> None:
        self.size, self.normalize = size, normalize
        self.rng = np.random.default_rng()

    def pil(self, img: Any) -> Any:
        """Upright, cropped, resized and flipped, still a PIL image."""
        import random

        from PIL import Image

        img = upright(img).convert("RGB")
        w = augment.random_resized_crop(random.Random(), img.width, img.height, SCALE, RATIO)
        img = img.crop((w.x, w.y, w.x + w.width, w.y + w.height))
        img = img.resize((self.size, self.size), Image.Resampling.BILINEAR)
        if w.flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return img

    def __call__(self, img: Any) -> Any:
        import torch

        out = torch.from_numpy(np.asarray(self.pil(img)).copy()).permute(2, 0, 1)
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


def _torchvision_broken(e: Exception) -> str:
    """A torchvision that is installed but fails to import: PyPI's wheels are built against
    PyPI's (CUDA) torch, and beside another build of the same torch (our CPU one) they raise
    a RuntimeError ("operator torchvision::nms does not exist"), not an ImportError."""
    return f"PIL re-implementation (torchvision fails to import: {type(e).__name__})"


def transform(size: int, normalize: bool) -> tuple[Any, str]:
    """torchvision's transforms when it is installed, else the same work in plain PIL; both
    turn photos upright first (`upright`), as our loader and DALI's decoders do."""
    try:
        from torchvision import transforms as v1
        from torchvision.transforms import v2
    except ImportError:
        return _PilTransform(size, normalize), "PIL re-implementation (no torchvision)"
    except Exception as e:  # installed but broken: see _torchvision_broken
        return _PilTransform(size, normalize), _torchvision_broken(e)
    if normalize:
        return v1.Compose([upright, v1.RandomResizedCrop(size), v1.RandomHorizontalFlip(),
                           v1.ToTensor(),
                           v1.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]), "v1"
    return v2.Compose([upright, v2.RandomResizedCrop(size), v2.RandomHorizontalFlip(),
                       v2.PILToTensor()]), "v2"


def folder_items(root: Path) -> list[tuple[Path, int]]:
    """ImageFolder's samples: every file of every class folder, with the index of its class
    among the sorted folder names as its label."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    return [(f, i) for i, c in enumerate(classes) for f in sorted((root / c).iterdir())
            if f.is_file()]


class _Folder:
    """ImageFolder: sorted class folders, PIL loading, a transform."""

    def __init__(self, root: Path, tf: Any) -> None:
        self.items = [(str(f), i) for f, i in folder_items(root)]
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
        except Exception:  # ImportError, or the RuntimeError of _torchvision_broken
            dataset: Any = _Folder(c.folder, tf)
        else:
            dataset = ImageFolder(str(c.folder), transform=tf)
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


# -- MosaicML Streaming and LitData: their own formats, written from the same image folder ------
#
# Both store each file's JPEG bytes as they are (no re-encoding) with its ImageFolder label,
# and decode with PIL + `transform(c.size, normalize=False)`: the same work as the other PIL
# contenders (EXIF upright, random-resized-crop, flip, uint8 CHW), without torchvision.
