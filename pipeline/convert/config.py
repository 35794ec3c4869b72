"""The options of a conversion (`tools/make_shards.py`'s flags, one to one), validated here.

Everything that decides the output bytes is compared on a rerun (the journal's `args`), so a
resumed job is the same job; workers, overwrite, the worker timeout, the engine and the storage
options are not (storage options hold credentials: they are never recorded or shown).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from shardflow.convert.parquet import ParquetOptions
from shardflow.convert.sources import SOURCE_KINDS, TextOptions
from shardflow.convert.tabular import TabularOptions
from shardflow.errors import OnError, check_on_error
from shardflow.samples.checks import CheckLimits
from shardflow.samples.scans import ScanOptions
from shardflow.shards.manifest import MANIFEST, part_manifest_name
from shardflow.storage import Store, check_storage_options, with_timeouts
from shardflow.urls import is_remote, redact


@dataclass(frozen=True)
class ConvertConfig:
    """Everything that decides the output bytes (plus workers and overwrite, which don't)."""

    kind: str
    src: str
    out: str  # a folder, or an fsspec URL prefix (s3://bucket/train); a Path is taken too
    prefix: str = "train"
    max_count: int = 10_000
    max_size: int = 512 * 1024 * 1024
    shuffle_seed: int | None = None
    part: tuple[int, int] = (0, 1)
    on_error: OnError = "raise"
    limits: CheckLimits = field(default_factory=CheckLimits)
    text: TextOptions = field(default_factory=TextOptions)
    path_column: str = "path"
    label_column: str = "label"
    mask_column: str | None = None  # manifest: each image's mask, stored as KEY.seg.png
    classes: dict[str, int] | None = None  # reuse an earlier conversion's class map
    parquet: ParquetOptions = field(default_factory=ParquetOptions)  # the parquet kind's columns
    tabular: TabularOptions = field(default_factory=TabularOptions)  # the tabular kind's
    scan: ScanOptions = field(default_factory=ScanOptions)  # point clouds: layout, labels
    max_file_bytes: int = 1024 * 1024 * 1024
    max_member_bytes: int = 256 * 1024 * 1024
    workers: int = field(default=os.cpu_count() or 1, compare=False)
    overwrite: bool = field(default=False, compare=False)
    # seconds a chunk of inputs may take in a worker process before it is declared hung
    worker_timeout_s: float = field(default=900.0, compare=False)
    # fsspec's options for the URLs of the source (kind "shards") and of `out`: endpoint,
    # credentials... (pipeline/storage.py); never recorded, compared or shown
    storage_options: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # where the workers run: "local" (processes here) or "ray" (Ray tasks: engine_ray.py) on
    # the cluster at `ray_address`, or on a local Ray of `workers` CPUs when it is None. The
    # output bytes are the same either way, so neither is recorded or compared.
    engine: Literal["local", "ray"] = field(default="local", compare=False)
    ray_address: str | None = field(default=None, compare=False)
    # A run that writes no sample is refused (convert/nothing.py) unless this is set; it
    # decides whether the manifest is written, not what it holds: not recorded or compared.
    allow_empty: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        # A local folder as pathlib writes it (so a journal from before URLs still matches).
        out = str(self.out)
        object.__setattr__(self, "out", out.rstrip("/") if is_remote(out) else str(Path(out)))
        check_storage_options(self.storage_options)
        # the connect and read timeouts (storage.py), unless set already (--timeout, the user)
        object.__setattr__(self, "storage_options",
                           with_timeouts(self.storage_options, self.src, self.out))
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"kind={self.kind!r}: choose one of {', '.join(SOURCE_KINDS)}")
        check_on_error(self.on_error)
        for name in ("max_count", "max_size", "workers", "max_file_bytes", "max_member_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if not self.worker_timeout_s > 0:  # also refuses NaN
            raise ValueError(f"worker_timeout_s={self.worker_timeout_s}: must be above 0")
        if not self.prefix or any(c in self.prefix for c in "./\\ "):
            raise ValueError(f"prefix={self.prefix!r}: use letters, digits, '-' or '_'")
        index, count = self.part
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"part={index}/{count}: expected i/n with 0 <= i < n (0-based)")
        self._check_engine()
        self._check_tokenizer()
        if self.scan != ScanOptions() and self.kind != "pointcloud":
            raise ValueError(f"scan options ({self.scan.layout} layout, labels per point) "
                             "are for the pointcloud kind")
        if self.kind == "tabular":  # a preset fills in what the flags leave unset
            object.__setattr__(self, "tabular", self.tabular.resolved())
            self.tabular.validate()

    def _check_tokenizer(self) -> None:
        spec = self.text.tokenizer
        if spec is None:
            return
        if self.kind not in ("text", "shards"):
            raise ValueError(f"tokenizer={spec!r}: documents are tokenized at conversion by the "
                             "text and shards kinds only")
        from shardflow.text.tokenizer import load_tokenizer

        sha = load_tokenizer(spec).describe().get("sha256")  # a bad file fails here, early
        object.__setattr__(self, "text", replace(self.text, tokenizer_sha256=sha))

    def _check_engine(self) -> None:
        if self.engine not in ("local", "ray"):
            raise ValueError(f"engine={self.engine!r}: choose local or ray")
        if self.ray_address is not None and self.engine != "ray":
            raise ValueError(f"ray_address={redact(self.ray_address)!r} is for engine='ray' "
                             "(make_shards --engine ray --ray-address ADDR)")

    @property
    def stem(self) -> str:
        index, count = self.part
        return self.prefix if count == 1 else f"{self.prefix}-p{index:03d}"

    def store(self) -> Store:
        """Where the shards go (a folder or an object-store prefix)."""
        return Store(self.out, self.storage_options)

    @property
    def manifest_name(self) -> str:
        return MANIFEST if self.part[1] == 1 else part_manifest_name(*self.part)

    def job_args(self) -> dict[str, object]:
        """The arguments as recorded in the manifest and compared on resume (URLs redacted)."""
        args = asdict(self)
        args.update(src=redact(self.src), out=redact(self.out), part=list(self.part))
        for name in ("workers", "overwrite", "worker_timeout_s", "storage_options", "engine",
                     "ray_address", "allow_empty"):
            args.pop(name)
        if self.kind != "parquet":  # the other kinds' arguments stay as they were
            args.pop("parquet")
        if self.kind != "tabular":
            args.pop("tabular")
        if self.scan == ScanOptions():  # a label per cloud, .bin of 4: the arguments as they were
            args.pop("scan")
        if self.text.tokenizer is None:  # as recorded before documents could be tokenized
            for name in ("tokenizer", "tokenizer_sha256"):
                args["text"].pop(name)
        return json.loads(json.dumps(args))
