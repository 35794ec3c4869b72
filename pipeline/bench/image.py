"""The image loader benchmark: ours beside the baselines of BENCHMARKS.md, same bytes, same
work (random-resized-crop to `size`, horizontal flip, uint8 out, batch and thread counts equal).

Each contender is an object whose `epoch()` reads the whole corpus once and returns the number
of images; `pipeline.bench.alternate` runs them A B C... after a warm-up and keeps medians.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib
import io
import multiprocessing
import os
import shutil
import sys
from collections.abc import Callable, Iterator
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

    def __init__(self, c: Corpus, whole_rows: bool = False, **options: Any) -> None:
        from pipeline.image.loader import image_loader

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

def shard_bytes(c: Corpus) -> int:
    """The mean size of the corpus's shards: the other formats' shards are made as large, so
    that every streaming loader spreads as many files over its workers."""
    tars = sorted(c.shards.glob("*.tar"))
    return max(sum(t.stat().st_size for t in tars) // max(len(tars), 1), 1 << 16)


class _DecodeJpeg:
    """JPEG bytes -> PIL image -> `tf` (in the loader's workers)."""

    def __init__(self, tf: Any) -> None:
        self.tf = tf

    def __call__(self, data: bytes) -> Any:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            return self.tf(img)


def streaming_base() -> Any:
    """mosaicml-streaming's `streaming.base` (MDSWriter, StreamingDataset, StreamingDataLoader);
    ImportError where it is not installed.

    The package's own __init__ also imports its vision datasets, hence torchvision, which fails
    beside our CPU torch (see _torchvision_broken) or where torchvision is missing. Nothing used
    here needs them, so the package is then entered without running its __init__ (a package
    module made from its spec; its submodules import as usual). DataLoader workers are forked
    (Linux's default) and inherit it."""
    import importlib.util

    try:
        return importlib.import_module("streaming.base")
    except Exception:  # ImportError or RuntimeError, from torchvision or from streaming itself
        spec = importlib.util.find_spec("streaming")
        if spec is None or not spec.submodule_search_locations:
            raise
    package = importlib.util.module_from_spec(spec)
    sys.modules["streaming"] = package
    package.base = importlib.import_module("streaming.base")
    return package.base


def write_mds(folder: Path, out: Path, size_limit: int = 1 << 26) -> int:
    """The image folder as MDS shards in `out` (replaced), with MosaicML Streaming's MDSWriter:
    columns `jpg` (the file's bytes) and `cls` (its ImageFolder label), no compression.
    Returns the number of samples written."""
    sb = streaming_base()
    shutil.rmtree(out, ignore_errors=True)
    items = folder_items(folder)
    with sb.MDSWriter(out=str(out), columns={"jpg": "bytes", "cls": "int"},
                      size_limit=size_limit, progress_bar=False) as writer:
        for path, label in items:
            writer.write({"jpg": path.read_bytes(), "cls": label})
    return len(items)


@functools.cache
def _mds_images() -> Any:
    """A StreamingDataset whose samples are (uint8 CHW image, label), decoded in the workers
    (streaming's documented way: a subclass overriding __getitem__)."""
    sb = streaming_base()

    class MdsImages(sb.StreamingDataset):  # type: ignore[misc,name-defined]
        def __init__(self, *, decode: _DecodeJpeg, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.decode = decode

        def __getitem__(self, i: int) -> tuple[Any, int]:
            sample = super().__getitem__(i)
            return self.decode(sample["jpg"]), int(sample["cls"])

    return MdsImages


_streaming_shm_cleaned = False


def _clean_streaming_shm_once() -> None:
    """streaming's clean_stale_shared_memory(), once per process and before this process's
    first StreamingDataset: it unlinks every streaming segment it finds, live ones included,
    so it must not run while one of ours is in use (streaming advises the same). What a killed
    run left behind goes; a second construction in the same process just takes the next
    shared-memory prefix, as streaming does."""
    global _streaming_shm_cleaned
    if not _streaming_shm_cleaned:
        importlib.import_module("streaming.base.util").clean_stale_shared_memory()
        _streaming_shm_cleaned = True


@contextlib.contextmanager
def _tempdir(path: Path) -> Iterator[None]:
    """tempfile.gettempdir() is `path` (made) meanwhile, in this process."""
    import tempfile

    path.mkdir(parents=True, exist_ok=True)
    old, tempfile.tempdir = tempfile.tempdir, str(path)
    try:
        yield
    finally:
        tempfile.tempdir = old


class MosaicStreaming:
    """MosaicML Streaming: MDS shards by its MDSWriter (in `mds/` beside the shards, as large
    as ours), read by its StreamingDataset in local-only mode (`local` is the MDS folder, no
    remote: nothing is copied), shuffled, PIL + our transform in `threads` workers of its
    StreamingDataLoader.

    The dataset's file locks (tempfile.gettempdir(), read when it is made: /tmp/NNNNNN_*_filelock,
    never removed) go to `mds-locks/` beside the shards; its shared memory (/dev/shm/NNNNNN_*)
    is released when the process ends."""

    def __init__(self, c: Corpus) -> None:
        sb = streaming_base()
        self.dir = c.shards.parent / "mds"
        write_mds(c.folder, self.dir, shard_bytes(c))
        _clean_streaming_shm_once()
        tf, _ = transform(c.size, normalize=False)
        with _tempdir(c.shards.parent / "mds-locks"):
            self.dataset = _mds_images()(local=str(self.dir), remote=None, shuffle=True,
                                         batch_size=c.batch_size, decode=_DecodeJpeg(tf))
        self.loader = sb.StreamingDataLoader(self.dataset, batch_size=c.batch_size,
                                             num_workers=c.threads, persistent_workers=True)

    def epoch(self) -> int:
        return sum(len(images) for images, _ in self.loader)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _litdata_sample(item: tuple[str, int]) -> dict[str, Any]:
    """optimize()'s function (in its worker processes): a file -> its sample."""
    path, label = item
    return {"jpg": Path(path).read_bytes(), "cls": label}


def write_litdata(folder: Path, out: Path, workers: int, chunk_bytes: int = 1 << 26) -> int:
    """The image folder as a LitData dataset in `out` (replaced), with `litdata.optimize` in
    `workers` processes: samples {"jpg": the file's bytes, "cls": its ImageFolder label}.
    Each worker takes a fixed slice of the files in order (no reordering by size, no shared
    queue), so the same folder gives the same chunks. Its scratch folders (by default
    /tmp/chunks and /tmp/data, which it empties first) go to `out`.cache, removed after.
    Returns the number of samples written."""
    litdata = litdata_module()
    shutil.rmtree(out, ignore_errors=True)
    scratch = out.with_name(out.name + ".cache")
    shutil.rmtree(scratch, ignore_errors=True)
    items = [(str(path), label) for path, label in folder_items(folder)]
    # optimize() sets the process-wide start method (to spawn, its default) with force=True;
    # left so, every DataLoader made after it here would spawn its workers instead of forking.
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        with _environ(DATA_OPTIMIZER_CACHE_FOLDER=str(scratch / "chunks"),
                      DATA_OPTIMIZER_DATA_CACHE_FOLDER=str(scratch / "data")):
            litdata.optimize(fn=_litdata_sample, inputs=items, output_dir=str(out),
                             num_workers=workers, chunk_bytes=chunk_bytes, reorder_files=False,
                             keep_data_ordered=True, verbose=False)
    finally:
        multiprocessing.set_start_method(start_method, force=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return len(items)


def litdata_module() -> Any:
    """The litdata package; ImportError where it is not installed."""
    return importlib.import_module("litdata")


# The contenders that need the bench extra (pip install -e ".[bench]"): their package, and
# what imports it.
def ffcv_module() -> Any:
    return importlib.import_module("ffcv")


OPTIONAL_PACKAGES: dict[str, tuple[str, Callable[[], Any]]] = {
    "MosaicML Streaming": ("mosaicml-streaming", streaming_base),
    "LitData": ("litdata", litdata_module),
    "FFCV": ("ffcv", ffcv_module)}
# How each optional package is installed
INSTALL = {"ffcv": "make bench-ffcv (Debian's OpenCV and libjpeg-turbo, then ffcv)"}


def importable(name: str) -> bool:
    """Whether the package of the optional contender `name` imports; if not, a one-line note
    on stderr that says which package is missing."""
    package, load = OPTIONAL_PACKAGES[name]
    try:
        load()
    except Exception as e:  # noqa: BLE001 - a broken install (numba, a .so) is a missing one
        how = INSTALL.get(package, 'the bench extra: pip install -e ".[bench]"')
        print(f"note: {name} not measured: {package} does not import ({e}); install it with "
              f"{how}", file=sys.stderr)
        return False
    return True


class _LitdataDecode:
    """LitData's per-sample transform: {"jpg", "cls"} -> (uint8 CHW image, label)."""

    def __init__(self, decode: _DecodeJpeg) -> None:
        self.decode = decode

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, int]:
        return self.decode(sample["jpg"]), int(sample["cls"])


class LitData:
    """LitData: `litdata.optimize` (in `threads` processes) into `litdata/` beside the shards,
    chunks as large as ours, read by its StreamingDataset (a local input_dir: read in place,
    no cache copy) shuffled, PIL + our transform in `threads` workers of its
    StreamingDataLoader."""

    def __init__(self, c: Corpus) -> None:
        from litdata import StreamingDataLoader, StreamingDataset

        self.dir = c.shards.parent / "litdata"
        write_litdata(c.folder, self.dir, c.threads, shard_bytes(c))
        tf, _ = transform(c.size, normalize=False)
        self.dataset = StreamingDataset(input_dir=str(self.dir), shuffle=True, drop_last=False,
                                        transform=_LitdataDecode(_DecodeJpeg(tf)))
        self.loader = StreamingDataLoader(self.dataset, batch_size=c.batch_size,
                                          num_workers=c.threads, persistent_workers=True)

    def epoch(self) -> int:
        return sum(len(images) for images, _ in self.loader)
