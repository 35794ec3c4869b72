"""The conversion job behind `tools/make_shards.py`: source -> checked samples -> shards.

    plan (sorted tasks, stable keys) -> order (shuffle seed, part slice) -> workers check and
    build samples -> ShardWriter (limits, atomic) -> journal after each shard -> manifest

The output folder (refused, cleaned or resumed) and the journal that makes a rerun continue
after a kill are in outdir.py; the manifest, written last, marks a finished job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import random
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardflow import executor
from shardflow.convert import engine_ray, nothing, outdir
from shardflow.convert.config import ConvertConfig
from shardflow.convert.outdir import JOURNAL, Journal
from shardflow.convert.parquet import ParquetPlan, plan_parquet
from shardflow.convert.parquet_rows import RowChunk, build_rows, row_tasks
from shardflow.convert.scan_plan import plan_scans
from shardflow.convert.sources import (
    InputItem,
    Plan,
    TextOptions,
    build_samples,
    make_keys,
    plan_imagefolder,
    plan_manifest,
    plan_pointcloud,
    plan_text,
)
from shardflow.convert.tabular import TabularPlan, plan_tabular
from shardflow.convert.tabular_rows import RowBlock, block_tasks, build_block
from shardflow.errors import DataError, SkipLog, handle
from shardflow.samples.checks import (
    OFFSET_EXT,
    CheckLimits,
    modality_of,
    repair_sample,
)
from shardflow.samples.scans import LABEL_COUNTS, LABELS_EXT, ScanOptions, labels_header
from shardflow.shards import segstats
from shardflow.shards.daliindex import has_whitespace
from shardflow.shards.listing import list_shards, preflight
from shardflow.shards.manifest import (
    MANIFEST,
    LabelStats,
    Manifest,
    ShardInfo,
    TokenForm,
    parse_manifest,
)
from shardflow.shards.tarread import TarLimits, iter_regrouped
from shardflow.shards.writer import Packed, ShardWriter, pack
from shardflow.storage import Store, timed
from shardflow.text import pretokenized
from shardflow.text.tokenizer import Tokenizer, load_tokenizer
from shardflow.urls import redact

log = logging.getLogger(__name__)

Progress = Callable[[int, int, "int | None"], None]  # samples, bytes so far; total if known
SHUFFLE_BUFFER = 10_000  # samples held when shuffling a stream of existing shards


# -- planning and ordering ---------------------------------------------------------------------

def make_plan(cfg: ConvertConfig) -> Plan:
    src = Path(cfg.src)
    if cfg.kind == "imagefolder":
        return plan_imagefolder(src, cfg.classes)
    if cfg.kind == "pointcloud" and cfg.scan.per_point:
        return plan_scans(src, cfg.scan)
    if cfg.kind == "pointcloud":
        return plan_pointcloud(src, cfg.classes)
    if cfg.kind == "text":
        return plan_text(src, cfg.text)
    if cfg.kind == "manifest":
        return plan_manifest(src, cfg.path_column, cfg.label_column, cfg.classes,
                             cfg.mask_column)
    if cfg.kind == "parquet":
        return plan_parquet(src, cfg.parquet, cfg.classes)
    if cfg.kind == "tabular":
        return plan_tabular(src, cfg.tabular)
    return Plan("unknown", [])  # shards: streamed, see shard_tasks


def order_tasks(tasks: list[InputItem], cfg: ConvertConfig) -> list[InputItem]:
    """Shuffle with the seed (if any), then take this part's contiguous slice."""
    if cfg.shuffle_seed is not None:
        tasks = list(tasks)
        random.Random(cfg.shuffle_seed).shuffle(tasks)
    index, count = cfg.part
    return tasks[index * len(tasks) // count: (index + 1) * len(tasks) // count]


def shard_tasks(cfg: ConvertConfig, skips: SkipLog) -> Iterator[dict[str, object] | DataError]:
    """Samples of existing shards (this part's slice of them), keys made safe and unique."""
    urls = list_shards(cfg.src, cfg.storage_options)
    preflight(urls, cfg.src, cfg.storage_options)
    index, count = cfg.part
    urls = urls[index * len(urls) // count: (index + 1) * len(urls) // count]
    stream = _unique_keys(_read_shards(urls, cfg, skips))
    if cfg.shuffle_seed is not None:
        stream = _buffer_shuffle(stream, random.Random(cfg.shuffle_seed))
    return stream


def _read_shards(urls: list[str], cfg: ConvertConfig, skips: SkipLog
                 ) -> Iterator[dict[str, object] | DataError]:
    import fsspec

    limits = TarLimits(cfg.max_member_bytes)
    for url in urls:
        try:
            with timed("reading shard", url, cfg.storage_options), \
                    fsspec.open(url, "rb", **cfg.storage_options) as f:
                # its keys' members put back together: a shard from `tar -cf` of a folder
                yield from iter_regrouped(f, redact(url), limits=limits,
                                          on_error=cfg.on_error, skips=skips)
        except DataError as err:
            yield err  # the shard is damaged from here on; the error says where


def _unique_keys(stream: Iterable[dict[str, object] | DataError]
                 ) -> Iterator[dict[str, object] | DataError]:
    """Each sample's key made safe (sources.make_keys); where that makes it another
    sample's key (`猫` and `狗` both `sample`, `img(1)` and `img_1`), a hash of the key as
    written is added, as make_keys adds one to clashing paths. Only a key written twice is a
    duplicate. Both sets grow with the samples, a few dozen bytes each."""
    written: set[str] = set()
    given: set[str] = set()
    for item in stream:
        if isinstance(item, dict):
            item = _whitespace(item) or _unique(item, written, given)
        yield item


def _whitespace(item: dict[str, object]) -> DataError | None:
    """A member whose extension holds whitespace (`p2.final version.jpg`): the shard's DALI
    index splits its fields on whitespace, and no loader asks for such a member; the sample
    is refused (the key is made safe below, the extension is kept as it is)."""
    odd = next((ext for ext in item if not ext.startswith("__") and has_whitespace(ext)), None)
    if odd is None:
        return None
    return DataError("whitespace-name", f"member extension {odd!r} holds whitespace, which a "
                     "shard's index cannot hold: rename the file so that its extension has "
                     "none", source=str(item["__url__"]), key=str(item["__key__"]))


def _unique(item: dict[str, object], written: set[str], given: set[str]
            ) -> dict[str, object] | DataError:
    original = str(item["__key__"])
    if original in written:
        return DataError("duplicate-key", "the key is already used by an earlier sample",
                         source=str(item["__url__"]), key=original)
    written.add(original)
    key = make_keys([original])[0]
    if key in given:  # made safe, it meets another sample's key
        key = f"{key}-{hashlib.sha1(original.encode()).hexdigest()[:10]}"
        if key in given:  # a key written as that hashed name: nothing is renamed twice
            return DataError("duplicate-key", f"made safe, the key is {key!r}, which an "
                             "earlier sample already has", source=str(item["__url__"]),
                             key=original)
    given.add(key)
    return {**item, "__key__": key}


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
    # fsspec's options for URLs a CSV/JSONL manifest lists (never shown)
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    # Worker processes on this machine send a local image kept as stored by its path
    # (writer.FileRef): the parent reads it from the page cache, cheaper than a pipe.
    refs: bool = False
    scan: ScanOptions = field(default_factory=ScanOptions)  # scans labelled per point


Task = InputItem | RowChunk | RowBlock | dict[str, object] | DataError


def run_task(task: Task, work: _Work) -> list[Packed | DataError]:
    """The task's samples, checked and packed as tar bytes (writer.Packed: packing in the
    workers leaves the one process that writes shards little to do per sample)."""
    built = _built(task, work)
    if work.text.tokenizer is not None:
        tokenizer = _tokenizer(work.text.tokenizer)  # documents stored as ids (--tokenizer)
        source = task.path if isinstance(task, InputItem) else ""
        built = pretokenized.encode_samples(built, tokenizer, pretokenized.form_of(tokenizer),
                                            source)
    return [item if isinstance(item, DataError) else pack(item) for item in built]


@functools.lru_cache(maxsize=2)
def _tokenizer(spec: str) -> Tokenizer:
    """One load per worker process, not one per task."""
    return load_tokenizer(spec)


def _built(task: Task, work: _Work) -> list[dict[str, object] | DataError]:
    if isinstance(task, DataError):
        return [task]
    if isinstance(task, RowChunk):
        return build_rows(task, work.limits)
    if isinstance(task, RowBlock):
        return build_block(task)
    if isinstance(task, dict):
        try:
            return [_with_label_counts(repair_sample(task, work.limits))]
        except DataError as err:
            return [err]
    return build_samples(task, work.limits, work.text, work.max_file_bytes,
                         work.storage_options, work.refs, work.scan)


# -- the job ---------------------------------------------------------------------------------------

def convert(cfg: ConvertConfig, progress: Progress | None = None) -> Manifest:
    """Run (or finish) a conversion; returns the manifest it wrote."""
    if cfg.engine == "ray" and not engine_ray.connected():
        with engine_ray.session(cfg.ray_address, cfg.workers):  # up before OUT is touched
            return convert(cfg, progress)
    outdir.not_in_place(cfg)
    _refuse_tokenizing_ids(cfg)
    plan = make_plan(cfg)
    if _listed(plan, cfg) and not order_tasks(plan.tasks, cfg):
        nothing.refuse_empty(cfg, plan, [], 0)  # before OUT is touched: --overwrite kept it
    store = cfg.store()
    journal = outdir.prepare_out(cfg, store)
    skips = SkipLog()
    tasks: Iterable[Task]
    ahead = 0  # tasks the stream already starts after (a resumed parquet job seeks)
    if isinstance(plan, ParquetPlan):
        ahead = journal.position[0]
        tasks = row_tasks(plan, cfg.part, cfg.shuffle_seed, ahead)
    elif isinstance(plan, TabularPlan):
        tasks = block_tasks(plan, cfg.part, cfg.shuffle_seed)
    else:
        tasks = shard_tasks(cfg, skips) if cfg.kind == "shards" else order_tasks(plan.tasks, cfg)
    # Shards are written whole in a local folder (the output folder itself, or one to upload
    # from to an object store) and only then get their final names (_Job._finish_shard).
    with store.staging() as staging:
        writer = ShardWriter(staging, cfg.stem, max_count=cfg.max_count, max_size=cfg.max_size,
                             start_index=len(journal.shards))
        job = _Job(cfg, journal, writer, skips, progress)
        job.total = plan.part_rows(cfg.part) if isinstance(plan, ParquetPlan) \
            else _expected_samples(tasks)
        try:
            work = _Work(cfg.limits, cfg.text, cfg.max_file_bytes, cfg.storage_options,
                         refs=_refs(cfg), scan=cfg.scan)
            job.run(tasks, work, ahead)
        except BaseException:
            writer.abort()
            raise
        return job.finish(plan)


def _listed(plan: Plan, cfg: ConvertConfig) -> bool:
    """Whether `plan.tasks` is every task (not a stream: shards, parquet, tabular)."""
    return cfg.kind != "shards" and not isinstance(plan, (ParquetPlan, TabularPlan))


class _Job:
    """The write loop's state: position in the task list, skips, the journal."""

    def __init__(self, cfg: ConvertConfig, journal: Journal, writer: ShardWriter,
                 skips: SkipLog, progress: Progress | None) -> None:
        self.cfg, self.journal, self.writer, self.progress = cfg, journal, writer, progress
        self.store = cfg.store()  # where finished shards, the journal and the manifest go
        self.skips = skips
        self.skips.extend(journal.skipped)
        self.total: int | None = None
        self.written = sum(int(s["samples"]) for s in journal.shards)  # type: ignore[call-overload]
        self.bytes = sum(int(s["bytes"]) for s in journal.shards)  # type: ignore[call-overload]
        self.tally = _Tally.resume(journal)

    def run(self, tasks: Iterable[Task], work: _Work, ahead: int = 0) -> None:
        """Convert from the journal's position on; `tasks` starts `ahead` tasks in."""
        start_task, start_result = self.journal.position
        self.end = (start_task, start_result)
        # A parquet task is a chunk of rows (up to a few MB): one per submit bounds what waits.
        chunk = 1 if self.cfg.kind in ("parquet", "tabular") else executor.CHUNK
        window: int | None = None
        helping: dict[str, Any] = {}
        if work.refs and self.cfg.kind == "imagefolder" and not self.cfg.limits.downsize:
            # Every result names a file (its images are local and kept as stored, unless
            # repaired), so results are small: larger chunks (fewer messages and wake-ups
            # for this process), and workers that run further ahead, through this process's
            # pauses to sync a finished shard. And this process, which writes every sample,
            # converts too while it would wait (executor.ordered_map's helping): --workers N
            # is N - 1 processes beside it. (Its own chunks have no timeout, as with one
            # worker: local files, not a server that may stall.)
            chunk, window = 2 * chunk, 8 * self.cfg.workers
            # its own images are in hand: no file to read again
            helping = {"helping": True, "own_extra": dataclasses.replace(work, refs=False)}
        results = _ordered_map(self.cfg)(run_task, _skip(tasks, start_task - ahead), work,
                                       self.cfg.workers, chunk=chunk, window=window,
                                       timeout_s=self.cfg.worker_timeout_s, describe=_describe,
                                       **helping)
        with contextlib.closing(results):  # stop the workers here, also on an error
            for n, outputs in enumerate(results, start_task):
                first = start_result if n == start_task else 0
                for r, item in enumerate(outputs[first:], first):
                    self._take(item, (n, r))
                self.end = (n + 1, 0)

    def _take(self, item: Packed | DataError, position: tuple[int, int]) -> None:
        if not isinstance(item, DataError):
            try:
                item = item.resolved()  # a file a worker sent by its path, read here
            except DataError as err:
                item = err.located(key=item.key)
        if isinstance(item, DataError):
            handle(item, self.cfg.on_error, self.skips)
            return
        if not self.writer.fits(item):
            self._finish_shard(position)
        self.writer.write(item)
        self.tally.add(item)  # after _finish_shard: the journal it saved excludes this item
        self.written += 1
        if self.progress:
            self.progress(self.written, self.bytes + self.writer.open_bytes, self.total)

    def _finish_shard(self, position: tuple[int, int]) -> None:
        info = self.writer.finish()
        if info is None:
            return
        # The index first, as the writer renames it first: a shard is never without it.
        self.store.publish(self.writer.out, info.name[: -len(".tar")] + ".idx", info.name)
        self.bytes += info.bytes
        self.journal.shards.append(info.to_json())
        self.journal.position = list(position)
        self.journal.skipped = list(self.skips.entries)
        self.tally.save(self.journal)
        self.journal.save(self.store)

    def finish(self, plan: Plan) -> Manifest:
        self._finish_shard(self.end)  # a rerun after this point has nothing left to convert
        nothing.refuse_empty(self.cfg, plan, self.skips.entries, self.written)  # unmarked
        shards = [ShardInfo.from_json(s) for s in self.journal.shards]
        modality = plan.modality
        if self.cfg.kind == "shards":
            modality = _modality_of(self.store, shards)
        manifest = Manifest(shards, modality, plan.classes, list(self.skips.entries),
                            plan.ignored, self.cfg.job_args(), reencoded=self.tally.reencoded,
                            offset_clouds=self.tally.offset_clouds,
                            labels=self.tally.label_stats(), tokens=self._tokens())
        manifest.segmentation = self._segmentation(plan)
        if isinstance(plan, TabularPlan):  # rows, blocks and the schema the loader reads
            manifest.tabular = {"schema": plan.schema.to_json(), "rows": self.tally.rows,
                                "blocks": manifest.total_samples,
                                "rows_per_block": plan.opts.rows_per_block}
        self.store.write_bytes(self.cfg.manifest_name, manifest.encode())  # last: finished
        self.store.delete(JOURNAL)
        return manifest


    def _segmentation(self, plan: Plan) -> dict[str, Any] | None:
        """The scans' section: this job's options, or, re-sharding scans, the source
        manifest's classes, names and ignore label; the counts are this job's own. Scans
        without labels (scan_plan.py) have none."""
        opts = self.cfg.scan
        if self.cfg.kind == "pointcloud" and plan.per_point:
            return segstats.section(self.tally.scans, opts.num_classes, opts.ignore_label,
                                    list(opts.class_names) if opts.class_names else None)
        if self.cfg.kind != "shards" or not self.tally.scans["frames"]:
            return None
        src = Store(self.cfg.src, self.cfg.storage_options)
        held = parse_manifest(src.read_bytes(MANIFEST), src.where(MANIFEST)).segmentation \
            if src.exists(MANIFEST) else None
        held = held or {}
        return segstats.section(self.tally.scans, held.get("num_classes"),
                                held.get("ignore_label"), held.get("class_names"))

    def _tokens(self) -> TokenForm | None:
        """How documents are stored as ids: this job's tokenizer's form, or, re-sharding
        shards of ids without one, the source manifest's."""
        if self.cfg.text.tokenizer is not None:
            return pretokenized.form_of(_tokenizer(self.cfg.text.tokenizer))
        return _source_tokens(self.cfg) if self.cfg.kind == "shards" else None


def _source_tokens(cfg: ConvertConfig) -> TokenForm | None:
    """The token form of the shards being re-sharded, from their folder's manifest."""
    src = Store(cfg.src, cfg.storage_options)
    if not src.exists(MANIFEST):
        return None
    return parse_manifest(src.read_bytes(MANIFEST), src.where(MANIFEST)).tokens


def _refuse_tokenizing_ids(cfg: ConvertConfig) -> None:
    """`shards --tokenizer` over shards that hold ids already would leave their ids as they
    are under the new tokenizer's name: refused before anything is written."""
    if cfg.kind != "shards" or cfg.text.tokenizer is None:
        return
    held = _source_tokens(cfg)
    if held is not None:
        raise ValueError(f"{redact(cfg.src)} holds token ids already ({held.tokenizer}, "
                         f"vocab_size {held.vocab_size}, in .{held.member}): re-shard them "
                         "without --tokenizer (the ids are kept), or convert the text again "
                         "with the other tokenizer")


class _Tally:
    """What the manifest says about the samples written besides their count: image repairs
    per reason, clouds stored with an offset, and the distinct labels."""

    def __init__(self, reencoded: dict[str, int], offset_clouds: int,
                 labels: set[int] | None, rows: int = 0,
                 scans: segstats.Stats | None = None) -> None:
        self.reencoded, self.offset_clouds = reencoded, offset_clouds
        self.rows = rows  # tabular rows written (a block sample holds many)
        self.scans = scans or segstats.empty()  # points per class of scans (segstats.py)
        self.labels = labels  # None: unknown (resumed from a journal that did not record them)

    @classmethod
    def resume(cls, journal: Journal) -> _Tally:
        if journal.labels is not None:
            labels: set[int] | None = set(LabelStats(tuple(
                (a, b) for a, b in journal.labels)).values())
        else:
            labels = None if journal.shards else set()
        return cls(dict(journal.reencoded), journal.offset_clouds, labels, journal.rows,
                   journal.scans)

    def add(self, sample: Packed) -> None:
        for reason in sample.get("__repairs__", ()):  # type: ignore[attr-defined]
            self.reencoded[reason] = self.reencoded.get(reason, 0) + 1
        self.offset_clouds += OFFSET_EXT in sample
        self.rows += int(sample.get("__rows__", 0))  # type: ignore[call-overload]
        if (counts := sample.get(LABEL_COUNTS)) is not None:
            segstats.add(self.scans, counts)  # type: ignore[arg-type]
        if self.labels is not None and isinstance(label := sample.get("cls"), bytes):
            self.labels.add(int(label))  # checked: an ASCII integer >= 0

    def save(self, journal: Journal) -> None:
        journal.reencoded, journal.offset_clouds = dict(self.reencoded), self.offset_clouds
        journal.rows = self.rows
        journal.scans = self.scans
        stats = self.label_stats()
        journal.labels = None if self.labels is None else \
            [list(r) for r in stats.ranges] if stats else []

    def label_stats(self) -> LabelStats | None:
        return LabelStats.of(self.labels) if self.labels else None


def _with_label_counts(sample: dict[str, object]) -> dict[str, object]:
    """A re-sharded scene's points per label (checked by repair_sample), for the manifest."""
    data = sample.get(LABELS_EXT)
    if not isinstance(data, bytes):
        return sample
    count, dtype, start = labels_header(data)
    labels = np.frombuffer(data, dtype=dtype, count=count, offset=start).astype(np.int64)
    if len(labels) and labels.min() < 0:
        raise DataError("bad-label", f"label {labels.min()} is below 0").located(
            source=str(sample.get("__url__", "")), key=str(sample.get("__key__", "")))
    counts = np.bincount(labels) if len(labels) else np.zeros(0, np.int64)
    return {**sample, LABEL_COUNTS: {int(c): int(counts[c]) for c in np.flatnonzero(counts)}}


def _expected_samples(tasks: Iterable[object]) -> int | None:
    """Samples to expect when every task is one file holding one sample (for an ETA)."""
    if not isinstance(tasks, list):
        return None
    if all(isinstance(t, InputItem) and t.mode in ("image", "points", "scan", "text")
           for t in tasks):
        return len(tasks)
    return None


def _refs(cfg: ConvertConfig) -> bool:
    """Whether workers send local images kept as stored by their path (writer.FileRef): with
    worker processes on this machine (not Ray's, which may run elsewhere), for the kinds
    whose images can be local files."""
    return cfg.workers > 1 and cfg.engine != "ray" and cfg.kind in ("imagefolder", "manifest")


def _ordered_map(cfg: ConvertConfig
                 ) -> Callable[..., Generator[list[Packed | DataError], None, None]]:
    """The engine: worker processes here, or Ray tasks (engine_ray.py); same order, same
    results, so the same shards."""
    return engine_ray.ordered_map if cfg.engine == "ray" else executor.ordered_map


def _skip(tasks: Iterable[Task], n: int) -> Iterator[Task]:
    for i, task in enumerate(tasks):
        if i >= n:
            yield task


def _modality_of(out: Store, shards: list[ShardInfo]) -> str:
    """A re-sharded dataset's modality, from the extensions in its first index."""
    from shardflow.shards.daliindex import parse_index

    if not shards:
        return "unknown"
    index = out.read_bytes(shards[0].name[:-4] + ".idx").decode()
    return modality_of({e[0] for s in parse_index(index) for e in s})


def _describe(item: Task) -> str:
    """An input as a worker error names it."""
    if isinstance(item, InputItem):
        return f"{redact(item.path)} key {item.key!r}"
    if isinstance(item, (RowChunk, RowBlock)):
        return item.describe()
    if isinstance(item, dict):
        return f"sample {item.get('__key__')!r}"
    return str(item)
