"""The image benchmark's peers in other streaming formats (the bench extra): MosaicML
Streaming (MDS shards, its StreamingDataset) and LitData (litdata.optimize, its
StreamingDataset), each written from the same image folder as ours and read with PIL and the
same transform in as many workers; and which optional peers import here (`importable`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import multiprocessing
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shardflow.tools.bench.image import Corpus, folder_items, transform


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
    package.base = importlib.import_module("streaming.base")  # type: ignore[attr-defined]
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
