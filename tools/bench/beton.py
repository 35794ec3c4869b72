"""FFCV beside us: the corpus's own JPEG bytes in a .beton file, read by FFCV's Loader with its
RandomResizedCropRGBImageDecoder (the same scale and ratio ranges), a flip, uint8 CHW out;
batch size and worker threads as every contender's.

    photo folder -> DatasetWriter (`threads` processes), each photo's bytes stored as they are
      (SameBytes: FFCV's own "jpg" mode would decode and re-encode them) with its stored size
    -> Loader(order RANDOM, `threads` workers) -> decode of the crop (libjpeg-turbo, scaled
       where the crop allows), resize (OpenCV), flip -> (N, 3, size, size) uint8

FFCV builds only against the system's OpenCV and libjpeg-turbo (its setup.py asks pkg-config):
`make bench-ffcv` installs Debian's packages and then ffcv (docs/benchmarks.md). FFCV does not
read EXIF orientation, so on photos with a turn its crops are of the stored pixels; the
built-in photos have none.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.samples.headers import read_header
from shardflow.tools.bench.image import Corpus, folder_items


def _same_bytes_field() -> Any:
    """An RGBImageField that stores the JPEG it is given, bytes for bytes."""
    from ffcv.fields.rgb_image import IMAGE_MODES, RGBImageField

    class SameBytes(RGBImageField):  # type: ignore[misc]
        def encode(self, destination: Any, image: Any, malloc: Any) -> None:
            header = read_header(image.tobytes())
            destination["mode"] = IMAGE_MODES["jpg"]
            destination["height"], destination["width"] = header.height, header.width
            destination["data_ptr"], storage = malloc(image.nbytes)
            storage[:] = image

    return SameBytes(write_mode="jpg")


class _Photos:
    """The folder as FFCV's writer indexes it: (the JPEG's bytes, the ImageFolder label)."""

    def __init__(self, folder: Path) -> None:
        self.items = folder_items(folder)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        path, label = self.items[i]
        return np.frombuffer(path.read_bytes(), np.uint8), label


def jpeg_only(folder: Path) -> bool:
    """Whether every photo is a JPEG: FFCV stores and decodes nothing else here (its decoder
    does not report a failure, so another format would read as garbage, fast); if not, a
    note says it was left out."""
    others = [p.name for p, _ in folder_items(folder) if p.read_bytes()[:2] != b"\xff\xd8"]
    if others:
        print(f"note: FFCV not measured: {len(others)} photos are not JPEGs (e.g. "
              f"{others[0]}), which its RandomResizedCropRGBImageDecoder cannot read",
              file=sys.stderr)
    return not others


def write_beton(folder: Path, out: Path, workers: int) -> int:
    """The folder's photos into the .beton file `out`; the number written."""
    from ffcv.fields import IntField
    from ffcv.writer import DatasetWriter

    photos = _Photos(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    DatasetWriter(str(out), {"image": _same_bytes_field(), "label": IntField()},
                  num_workers=workers).from_indexed_dataset(photos)
    return len(photos)


class Ffcv:
    """FFCV's Loader over `ffcv.beton` beside the shards (see the module's docstring)."""

    def __init__(self, c: Corpus) -> None:
        from ffcv.fields import RGBImageField
        from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
        from ffcv.loader import Loader, OrderOption
        from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

        from shardflow.tools.bench.image import RATIO, SCALE

        path = c.shards.parent / "ffcv.beton"
        write_beton(c.folder, path, c.threads)
        image = [RandomResizedCropRGBImageDecoder((c.size, c.size), scale=SCALE, ratio=RATIO),
                 RandomHorizontalFlip(), ToTensor(), ToTorchImage()]
        self.loader = Loader(str(path), batch_size=c.batch_size, num_workers=c.threads,
                             order=OrderOption.RANDOM, drop_last=False,
                             # SameBytes wrote what RGBImageField writes: FFCV reads it as one
                             custom_fields={"image": RGBImageField},
                             pipelines={"image": image,
                                        "label": [IntDecoder(), ToTensor(), Squeeze()]})

    def epoch(self) -> int:
        return sum(len(images) for images, _labels in self.loader)
