"""The conversion job behind `tools/make_shards.py`: source -> checked samples -> shards.

    plan (sorted tasks, stable keys) -> order (shuffle seed, part slice) -> workers check and
    build samples -> ShardWriter (limits, atomic) -> journal after each shard -> manifest

The journal (`.make_shards.journal.json`) records the finished shards and the position in the
task list after each one, so running the same command again after a kill continues where it
stopped; a finished job is marked by its manifest, written last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline import executor
from pipeline.checks import CheckLimits, check_sample
from pipeline.errors import DataError, OnError, SkipLog, check_on_error, handle
from pipeline.manifest import MANIFEST, Manifest, part_manifest_name
from pipeline.shardwriter import ShardInfo, ShardWriter, write_atomic
from pipeline.sources import (
    SOURCE_KINDS,
    Plan,
    Task,
    TextOptions,
    build_samples,
    list_shards,
    make_keys,
    plan_imagefolder,
    plan_manifest,
    plan_pointcloud,
    plan_text,
)
from pipeline.tarread import TarLimits, iter_samples
from pipeline.urls import redact

log = logging.getLogger(__name__)

JOURNAL = ".make_shards.journal.json"
Progress = Callable[[int, int, "int | None"], None]  # samples, bytes so far; total if known
SHUFFLE_BUFFER = 10_000  # samples held when shuffling a stream of existing shards


@dataclass(frozen=True)
class ConvertConfig:
    """Everything that decides the output bytes (plus workers and overwrite, which don't)."""

    kind: str
    src: str
    out: Path
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
    classes: dict[str, int] | None = None  # reuse an earlier conversion's class map
    max_file_bytes: int = 1024 * 1024 * 1024
    max_member_bytes: int = 256 * 1024 * 1024
    workers: int = field(default=os.cpu_count() or 1, compare=False)
    overwrite: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"kind={self.kind!r}: choose one of {', '.join(SOURCE_KINDS)}")
        check_on_error(self.on_error)
        for name in ("max_count", "max_size", "workers", "max_file_bytes", "max_member_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if not self.prefix or any(c in self.prefix for c in "./\\ "):
            raise ValueError(f"prefix={self.prefix!r}: use letters, digits, '-' or '_'")
        index, count = self.part
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"part={index}/{count}: expected i/n with 0 <= i < n (0-based)")

    @property
    def stem(self) -> str:
        index, count = self.part
        return self.prefix if count == 1 else f"{self.prefix}-p{index:03d}"

    @property
    def manifest_name(self) -> str:
        return MANIFEST if self.part[1] == 1 else part_manifest_name(*self.part)

    def job_args(self) -> dict[str, object]:
        """The arguments as recorded in the manifest and compared on resume (URLs redacted)."""
        args = asdict(self)
        args.update(src=redact(self.src), out=str(self.out), part=list(self.part))
        for name in ("workers", "overwrite"):
            args.pop(name)
        return json.loads(json.dumps(args))


@dataclass
class Journal:
    """Progress of an unfinished job: shards done and where in the task list they end."""

    args: dict[str, object]
    shards: list[dict[str, object]] = field(default_factory=list)
    position: list[int] = field(default_factory=lambda: [0, 0])  # [task, result within task]
    skipped: list[dict[str, str]] = field(default_factory=list)

    def save(self, out: Path) -> None:
        write_atomic(out / JOURNAL, json.dumps(asdict(self)).encode())

    @classmethod
    def load(cls, out: Path) -> Journal:
        return cls(**json.loads((out / JOURNAL).read_text()))


# -- the output folder -----------------------------------------------------------------------

def prepare_out(cfg: ConvertConfig) -> Journal:
    """Refuse, clean or resume the output folder; returns the journal to continue from."""
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    for tmp in out.glob(".*.tmp"):
        tmp.unlink()  # leftovers of a killed run: never under a final name, safe to drop
    if cfg.overwrite:
        _clean(out, cfg)
    elif (out / cfg.manifest_name).exists():
        raise FileExistsError(f"{out} already holds a finished conversion ({cfg.manifest_name});"
                              " pass --overwrite to replace it")
    elif (out / JOURNAL).exists():
        return _resume(out, cfg)
    elif foreign := _foreign_shards(out, cfg):
        raise FileExistsError(f"{out} already holds shards ({foreign[0].name} and "
                              f"{len(foreign) - 1} more); pass --overwrite to replace them")
    return Journal(cfg.job_args())


def _resume(out: Path, cfg: ConvertConfig) -> Journal:
    journal = Journal.load(out)
    if not _same_job(journal, cfg):
        raise FileExistsError(f"{out} holds an unfinished conversion made with other arguments;"
                              " rerun that command to finish it, or pass --overwrite")
    for name in _owned(out, cfg):
        if name.name not in {str(s["name"]) for s in journal.shards} | {
                str(s["name"])[:-4] + ".idx" for s in journal.shards}:
            name.unlink()  # renamed after the journal's last save: it will be written again
    log.info("resuming %s after %d finished shards", out, len(journal.shards))
    return journal


def _same_job(journal: Journal, cfg: ConvertConfig) -> bool:
    """Same arguments; the error policy may differ while nothing was skipped yet, since the
    finished shards are then the same under either policy (raise, then rerun with skip)."""
    mine, theirs = cfg.job_args(), dict(journal.args)
    if not journal.skipped:
        mine.pop("on_error")
        theirs.pop("on_error", None)
    return mine == theirs


def _owned(out: Path, cfg: ConvertConfig) -> list[Path]:
    pattern = f"{cfg.stem}-[0-9]*"
    return sorted(list(out.glob(pattern + ".tar")) + list(out.glob(pattern + ".idx")))


def _foreign_shards(out: Path, cfg: ConvertConfig) -> list[Path]:
    # Sibling parts of the same job may share the folder (one per machine).
    sibling = f"{cfg.prefix}-p" if cfg.part[1] > 1 else None
    return [p for p in sorted(out.glob("*.tar"))
            if not (sibling and p.name.startswith(sibling) and not p.name.startswith(cfg.stem))]


def _clean(out: Path, cfg: ConvertConfig) -> None:
    doomed = _owned(out, cfg) + _foreign_shards(out, cfg) + [out / JOURNAL, out / cfg.manifest_name]
    if cfg.part[1] == 1:
        doomed += list(out.glob("*.idx")) + list(out.glob("manifest*.json"))
    for path in doomed:
        path.unlink(missing_ok=True)


def _not_in_place(cfg: ConvertConfig) -> None:
    """Refuse to write into the folder being read: --overwrite would delete the source."""
    if cfg.kind != "shards" or "://" in cfg.src:
        return
    out = cfg.out.resolve()
    sources = [Path(u).resolve() for u in list_shards(cfg.src)]
    if any(p.parent == out for p in sources):
        raise ValueError(f"{cfg.out} holds the source shards; write the new shards to another "
                         "folder")


# -- planning and ordering ---------------------------------------------------------------------

def make_plan(cfg: ConvertConfig) -> Plan:
    src = Path(cfg.src)
    if cfg.kind == "imagefolder":
        return plan_imagefolder(src, cfg.classes)
    if cfg.kind == "pointcloud":
        return plan_pointcloud(src, cfg.classes)
    if cfg.kind == "text":
        return plan_text(src, cfg.text)
    if cfg.kind == "manifest":
        return plan_manifest(src, cfg.path_column, cfg.label_column, cfg.classes)
    return Plan("unknown", [])  # shards: streamed, see shard_tasks


def order_tasks(tasks: list[Task], cfg: ConvertConfig) -> list[Task]:
    """Shuffle with the seed (if any), then take this part's contiguous slice."""
    if cfg.shuffle_seed is not None:
        tasks = list(tasks)
        random.Random(cfg.shuffle_seed).shuffle(tasks)
    index, count = cfg.part
    return tasks[index * len(tasks) // count: (index + 1) * len(tasks) // count]


def shard_tasks(cfg: ConvertConfig, skips: SkipLog) -> Iterator[dict[str, object] | DataError]:
    """Samples of existing shards (this part's slice of them), keys made safe and unique."""
    urls = list_shards(cfg.src)
    _preflight(urls)
    index, count = cfg.part
    urls = urls[index * len(urls) // count: (index + 1) * len(urls) // count]
    stream = _unique_keys(_read_shards(urls, cfg, skips))
    if cfg.shuffle_seed is not None:
        stream = _buffer_shuffle(stream, random.Random(cfg.shuffle_seed))
    return stream


def _preflight(urls: list[str]) -> None:
    import fsspec

    if not urls:
        raise FileNotFoundError("no shards matched the source")
    missing = [u for u in urls if not fsspec.core.url_to_fs(u)[0].exists(u)]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {len(urls)} shards are missing: "
                                + ", ".join(redact(u) for u in missing))


def _read_shards(urls: list[str], cfg: ConvertConfig, skips: SkipLog
                 ) -> Iterator[dict[str, object] | DataError]:
    import fsspec

    limits = TarLimits(cfg.max_member_bytes)
    for url in urls:
        try:
            with fsspec.open(url, "rb") as f:
                yield from iter_samples(f, redact(url), limits=limits, on_error=cfg.on_error,
                                        skips=skips)
        except DataError as err:
            yield err  # the shard is damaged from here on; the error says where


def _unique_keys(stream: Iterable[dict[str, object] | DataError]
                 ) -> Iterator[dict[str, object] | DataError]:
    seen: set[str] = set()
    for item in stream:
        if isinstance(item, dict):
            key = make_keys([str(item["__key__"])])[0]
            if key in seen:
                item = DataError("duplicate-key", "key already used by an earlier shard",
                                 source=str(item["__url__"]), key=key)
            else:
                seen.add(key)
                item = {**item, "__key__": key}
        yield item


def _buffer_shuffle(stream: Iterable[dict[str, object] | DataError], rng: random.Random
                    ) -> Iterator[dict[str, object] | DataError]:
    buf: list[dict[str, object] | DataError] = []
    for item in stream:
        buf.append(item)
        if len(buf) >= SHUFFLE_BUFFER:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


# -- the worker side -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Work:
    """What a worker needs besides the task; picklable, sent once per chunk."""

    limits: CheckLimits
    text: TextOptions
    max_file_bytes: int


def run_task(task: Task | dict[str, object] | DataError, work: _Work
             ) -> list[dict[str, object] | DataError]:
    if isinstance(task, DataError):
        return [task]
    if isinstance(task, dict):
        try:
            check_sample(task, work.limits)
        except DataError as err:
            return [err]
        return [task]
    return build_samples(task, work.limits, work.text, work.max_file_bytes)


# -- the job ---------------------------------------------------------------------------------------

def convert(cfg: ConvertConfig, progress: Progress | None = None) -> Manifest:
    """Run (or finish) a conversion; returns the manifest it wrote."""
    _not_in_place(cfg)
    journal = prepare_out(cfg)
    skips = SkipLog()
    plan = make_plan(cfg)
    tasks: Iterable[Task | dict[str, object] | DataError]
    tasks = shard_tasks(cfg, skips) if cfg.kind == "shards" else order_tasks(plan.tasks, cfg)
    writer = ShardWriter(cfg.out, cfg.stem, max_count=cfg.max_count, max_size=cfg.max_size,
                         start_index=len(journal.shards))
    job = _Job(cfg, journal, writer, skips, progress)
    job.total = _expected_samples(tasks)
    try:
        job.run(tasks, _Work(cfg.limits, cfg.text, cfg.max_file_bytes))
    except BaseException:
        writer.abort()
        raise
    return job.finish(plan)


class _Job:
    """The write loop's state: position in the task list, skips, the journal."""

    def __init__(self, cfg: ConvertConfig, journal: Journal, writer: ShardWriter,
                 skips: SkipLog, progress: Progress | None) -> None:
        self.cfg, self.journal, self.writer, self.progress = cfg, journal, writer, progress
        self.skips = skips
        self.skips.extend(journal.skipped)
        self.total: int | None = None
        self.written = sum(int(s["samples"]) for s in journal.shards)  # type: ignore[call-overload]
        self.bytes = sum(int(s["bytes"]) for s in journal.shards)  # type: ignore[call-overload]

    def run(self, tasks: Iterable[Task | dict[str, object] | DataError], work: _Work) -> None:
        start_task, start_result = self.journal.position
        self.end = (start_task, start_result)
        results = executor.ordered_map(run_task, _skip(tasks, start_task), work, self.cfg.workers)
        with contextlib.closing(results):  # stop the workers here, also on an error
            for n, outputs in enumerate(results, start_task):
                first = start_result if n == start_task else 0
                for r, item in enumerate(outputs[first:], first):
                    self._take(item, (n, r))
                self.end = (n + 1, 0)

    def _take(self, item: dict[str, object] | DataError, position: tuple[int, int]) -> None:
        if isinstance(item, DataError):
            handle(item, self.cfg.on_error, self.skips)
            return
        if not self.writer.fits(item):
            self._finish_shard(position)
        self.writer.write(item)
        self.written += 1
        if self.progress:
            self.progress(self.written, self.bytes + self.writer.open_bytes, self.total)

    def _finish_shard(self, position: tuple[int, int]) -> None:
        info = self.writer.finish()
        if info is None:
            return
        self.bytes += info.bytes
        self.journal.shards.append(info.to_json())
        self.journal.position = list(position)
        self.journal.skipped = list(self.skips.entries)
        self.journal.save(self.cfg.out)

    def finish(self, plan: Plan) -> Manifest:
        self._finish_shard(self.end)  # a rerun after this point has nothing left to convert
        shards = [ShardInfo.from_json(s) for s in self.journal.shards]
        modality = plan.modality
        if self.cfg.kind == "shards":
            modality = _modality_of(self.cfg.out, shards)
        manifest = Manifest(shards, modality, plan.classes, list(self.skips.entries),
                            plan.ignored, self.cfg.job_args())
        manifest.save(self.cfg.out / self.cfg.manifest_name)
        (self.cfg.out / JOURNAL).unlink(missing_ok=True)
        return manifest


def _expected_samples(tasks: Iterable[object]) -> int | None:
    """Samples to expect when every task is one file holding one sample (for an ETA)."""
    if not isinstance(tasks, list):
        return None
    if all(isinstance(t, Task) and t.mode in ("image", "points", "text") for t in tasks):
        return len(tasks)
    return None


def _skip(tasks: Iterable[Task | dict[str, object] | DataError], n: int
          ) -> Iterator[Task | dict[str, object] | DataError]:
    for i, task in enumerate(tasks):
        if i >= n:
            yield task


def _modality_of(out: Path, shards: list[ShardInfo]) -> str:
    """A re-sharded dataset's modality, from the extensions in its first index."""
    from pipeline.daliindex import parse_index

    if not shards:
        return "unknown"
    exts = {e[0] for s in parse_index((out / (shards[0].name[:-4] + ".idx")).read_text())
            for e in s}
    for modality, names in (("image", {"jpg", "png", "jpeg"}), ("text", {"txt"}),
                            ("pointcloud", {"npy"})):
        if exts & names:
            return modality
    return "unknown"
