"""The options every loader shares, as one frozen dataclass the modality configs build on,
and the checks each config runs in `__post_init__` (messages name the option and the fix).

    @dataclass(frozen=True)
    class TextConfig(LoaderOptions):      # batch_size, train, seed, device, on_error, ...
        seq_len: int = 256

`GraphOptions` adds what the loaders that decode in a DALI graph share (images, point
clouds): DALI's CPU threads and the number of classes labels must stay below.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shardflow.errors import OnError, check_on_error
from shardflow.loading.holdout import KeyHoldout
from shardflow.storage import READ_TIMEOUT_S, check_storage_options

ReaderKind = Literal["auto", "dali", "stream", "index"]  # e.g. "stream" for remote shards
# Where batches land and training runs, e.g. device="cuda:1"; "gpu" is the older spelling of
# "cuda"; "auto": the current CUDA device when there is one, else the CPU.
Device = str
# Where decoding and augmentation run, e.g. decode="cpu" with device="cuda": CPU workers feed
# the GPU through pinned memory; "auto": on the GPU when batches land there and the modality
# can decode there (images, point clouds), else on the CPU.
Decode = Literal["auto", "cpu", "gpu"]
# What decodes and augments: "dali" (DALI graphs, DALI's reader for local indexed shards),
# "portable" (PIL/numpy + torch on the CPU, the streaming reader; runs where DALI does not
# install), "auto": DALI where nvidia.dali imports, else portable. E.g. backend="portable".
Backend = Literal["auto", "dali", "portable"]
_DEVICE = re.compile(r"auto|cpu|gpu|cuda(:\d+)?")


def cores() -> int:
    """CPU cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class LoaderOptions:
    """Options of every loader; each field is also a keyword argument of the loader."""

    batch_size: int
    train: bool = True  # shuffle and augment; False: a fixed order, no augmentation
    # The order alone, apart from `train` (torch's DataLoader(shuffle=)): None follows train
    shuffle: bool | None = None
    seed: int = 0
    device: Device = "auto"  # where batches land: "cpu", "cuda", "cuda:N" or "auto"
    decode: Decode = "auto"  # where decoding and augmentation run: "cpu", "gpu" or "auto"
    on_error: OnError = "raise"  # or "skip": drop a bad sample, count and name it
    # Batches prepared ahead of the consumer, per stage (packed text: hand-overs, each up to
    # text/loader.BURST batches of one read; a CPU DALI graph: prefetch + 1 batches)
    prefetch: int = 2
    shuffle_buffer: int = 1024  # samples held to shuffle within shards (0: none)
    # DALI's reader for local indexed shards, else streaming; "index": local indexed shards
    # through their .idx offsets, no DALI (auto for stored token ids: loading/reader_index.py)
    reader: ReaderKind = "auto"
    allow_pipe: bool = False  # `pipe:` URLs run a shell command: refused unless allowed
    timeout_s: float | None = 600.0  # no batch for this long: the loader is hung, raise
    backend: Backend = "auto"  # "dali", "portable" (no DALI needed) or "auto"
    # fsspec's options for the source's URLs (s3://, gs://, ...), e.g. {"anon": True} or
    # {"client_kwargs": {"endpoint_url": URL}, "key": ..., "secret": ...}: used to resolve and
    # read the shards, never shown, logged or saved (a loader's state has none)
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    # A server (http(s)://, s3://) that sends nothing for this long, or does not connect in
    # min(this, 10 s): retried mid-epoch, at build an error naming the URL (storage.py)
    io_timeout_s: float = READ_TIMEOUT_S
    # The streaming reader (remote shards, or no DALI): shards fetched at once per rank, their
    # samples interleaved; a local folder caching remote shards, bounded by cache_limit bytes
    # (least recently used out; shared by the ranks of a machine). See loading/shardcache.py.
    shards_in_flight: int = 2
    cache_dir: str | None = None
    cache_limit: int = 32 * 2**30
    # A folder with the shards' manifest.json and .idx files, for shards that have none beside
    # them (read-only or remote: `make_shards index SRC --out DIR`; shards/indexdir.py)
    index: str | None = None
    # Part of the dataset, by key (loading/subset.py): a fraction by (seed, key) hash; a list
    # or file of keys to take (exclude=True: to leave out); a predicate (key, small members)
    subsample: float | None = None
    keys: Any = field(default=None, repr=False, compare=False)
    exclude: bool = False
    select: Any = field(default=None, repr=False, compare=False)
    # One side of a split by key hash, e.g. KeyHoldout("eval", 10): only the held-out tenth
    # (loading/holdout.py; shardflow train's split of data with too few shards)
    holdout: KeyHoldout | None = None

    def __post_init__(self) -> None:
        positive(self, "batch_size", "prefetch", "shards_in_flight", "cache_limit")
        check_on_error(self.on_error)
        check_storage_options(self.storage_options)
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device={self.device!r}: choose cpu, cuda, cuda:N or auto")
        choice(self, "decode", ("auto", "cpu", "gpu"))
        choice(self, "reader", ("auto", "dali", "stream", "index"))
        choice(self, "backend", ("auto", "dali", "portable"))
        if self.backend == "portable" and (self.reader == "dali" or self.decode == "gpu"):
            raise ValueError(portable_conflict(self.reader, self.decode))
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer={self.shuffle_buffer}: use 0 for no shuffling")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s}: seconds > 0, or None to wait "
                             "forever")
        if not 0 < self.io_timeout_s < float("inf"):  # also refuses NaN
            raise ValueError(f"io_timeout_s={self.io_timeout_s}: seconds > 0 (default "
                             f"{READ_TIMEOUT_S:g})")
        if self.holdout is not None and not isinstance(self.holdout, KeyHoldout):
            raise ValueError(f"holdout={self.holdout!r}: pass KeyHoldout('train' or 'eval', "
                             "percent) from shardflow.loading.holdout, or None")


@dataclass(frozen=True)
class GraphOptions(LoaderOptions):
    """Options of the loaders that decode in a DALI graph (images, point clouds)."""

    threads: int = field(default_factory=cores)  # decode threads (DALI's, or the portable pool)
    num_classes: int | None = None  # labels must be below it (default: the manifest's)

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "threads")
        if self.num_classes is not None and self.num_classes < 1:
            raise ValueError(f"num_classes={self.num_classes}: must be positive (or None)")


def portable_conflict(reader: str, decode: str, why: str = "") -> str:
    """The message refusing reader="dali" or decode="gpu" with the portable backend (`why`:
    how the backend came to be portable, when it was not asked for by name)."""
    asked = "reader='dali'" if reader == "dali" else "decode='gpu'"
    fix = "reader='stream' (or 'auto')" if reader == "dali" else \
        "decode='cpu' (batches still land on the device)"
    return (f"{asked} needs DALI, but backend='portable'{why}: the portable backend reads "
            f"with the streaming reader and decodes on the CPU. Use {fix}, or backend='dali' "
            "where nvidia-dali-cuda120 is installed")


def positive(cfg: object, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")


def choice(cfg: object, name: str, choices: tuple[str, ...]) -> None:
    if getattr(cfg, name) not in choices:
        raise ValueError(f"{name}={getattr(cfg, name)!r}: choose one of {', '.join(choices)}")


def interval(cfg: object, name: str, low: float, high: float) -> None:
    lo, hi = getattr(cfg, name)
    if not low < lo <= hi <= high:
        raise ValueError(f"{name}={getattr(cfg, name)}: need {low} < low <= high <= {high}")


MIX_OPTIONS = ("epoch_batches", "epoch_samples", "mixing")  # a mixture's (loading/mix.py)


def check_names(function: str, given: Mapping[str, Any], config: type,
                also: Iterable[str] = MIX_OPTIONS) -> None:
    """TypeError for an option `function` does not take, naming the function and the
    closest names it does take (`crop_sacle` -> `crop_scale`), not the config class inside;
    checked before anything is read."""
    known = {f.name for f in dataclasses.fields(config)} | set(also)
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = (f"; did you mean {' or '.join(map(repr, close))}?" if close else
                    f"; it takes {', '.join(sorted(known))}")
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}{hint}")
