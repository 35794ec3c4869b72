"""The tabular loader: shards of row blocks -> decode and check each block -> feature hashing
of the categorical fields, dense transforms -> windows of rows shuffled -> batches of rows ->
`TabularBatch` on the device.

    from shardflow import tabular_loader
    with tabular_loader("shards/criteo", batch_size=4096, num_buckets=2**20) as loader:
        sizes = loader.schema.num_buckets      # one embedding table per categorical field
        for batch in loader:
            ...  # batch.dense float32 (4096, 13), batch.sparse int64 (4096, 26), batch.label

Two background stages overlap with the training step. The first takes the reader's blocks
(DALI's reader for local indexed shards, reading ahead in its own threads, or the streaming
reader), decodes them (pipeline/samples/tabular_block.py: no pickle, every array checked),
hashes the categorical values (hashing.py, numpy over each block's bytes) and transforms the
dense ones (dense.py), a window of rows at a time; the second cuts batches across the windows
(window.py) and copies them to the device through the pinned ring and side stream every
loader uses (loading/delivery.py). No DALI operator is involved: this is CPU work, as in the
text loader.

A batch is `batch_size` rows except the epoch's last. Ranks read the same number of blocks,
not of rows (a block with bad rows skipped, or a part's last block, is shorter), so under
torch.distributed the ranks agree when to stop (as packed text does) and the longer ones leave
their last rows out. `len()` is known for one rank reading a source whose manifest counts
its rows.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardflow.errors import DataError
from shardflow.loading import readers, settled, tuning
from shardflow.loading.agreement import rank_agreement
from shardflow.loading.batch import EncodedBatch, TabularBatch
from shardflow.loading.delivery import DeviceCopier
from shardflow.loading.loader import Loader, Produced
from shardflow.loading.options import check_names
from shardflow.loading.prefetch import Stage
from shardflow.loading.readplan import EpochPlan
from shardflow.loading.shardlist import Source
from shardflow.samples.tabular_block import BLOCK_EXT, Block, decode_block
from shardflow.tabular import dense as dense_features
from shardflow.tabular import hashing
from shardflow.tabular.config import FeatureSchema, TabularConfig
from shardflow.tabular.schema import SourceInfo, source_info
from shardflow.tabular.window import Cut, Window, Windows, rows_of

log = logging.getLogger(__name__)


def tabular_loader(source: str | Path | Sequence[str] | Source, *, batch_size: int,
                   num_buckets: int | Sequence[int] = 2**18, seed: int = 0,
                   rank: int | None = None, world_size: int | None = None,
                   tuning_file: Path | None = None, use_tuning: bool = True,
                   **options: Any) -> TabularLoader:
    """A resumable loader of row batches from tabular shards (see `TabularConfig` for the
    options: shuffle_buffer, hash_seed, dense_transform, fill, clip...). `num_buckets`: ids
    per categorical field (one int for all, or one per field); `loader.schema` says the
    columns and sizes. `source` may be a `Source` resolved already (resolve_source; e.g. a
    held-out part of one: its manifest's schema and counts travel with it).
    `rank`/`world_size` default to torch.distributed's."""
    check_names("tabular_loader", options, TabularConfig)
    resolved, tuned = tuning.source_and_options("tabular", source, options, tuning_file,
                                                use_tuning)
    options, record = settled.settle(options, tuned, tuning_file, {})
    buckets = num_buckets if isinstance(num_buckets, int) else tuple(num_buckets)
    cfg = TabularConfig(batch_size=batch_size, num_buckets=buckets, seed=seed, **options)
    rank, world_size = readers.distributed(rank, world_size)
    loader = TabularLoader(resolved, cfg, source_info(resolved), rank, world_size)
    loader.settled = record
    return loader


class TabularLoader(Loader):
    """Batches of rows on the target device. Build with `tabular_loader(...)`."""

    kind = "tabular"

    def __init__(self, source: Source, cfg: TabularConfig, info: SourceInfo, rank: int,
                 world_size: int) -> None:
        self.cfg, self.info = cfg, info
        fields = len(info.schema.categorical)
        self._buckets = hashing.as_buckets(cfg.num_buckets, fields)
        self._seeds = hashing.field_seeds(cfg.hash_seed, fields)
        self.schema = FeatureSchema(info.schema.label, list(info.schema.dense),
                                    list(info.schema.categorical), self._buckets.tolist(),
                                    info.rows, info.rows_per_block)
        # Blocks per read: a window of about shuffle_buffer rows (training), else a batch.
        rows = cfg.shuffle_buffer if cfg.train and cfg.shuffle_buffer else cfg.batch_size
        self.read_blocks = max(1, round(rows / info.rows_per_block))
        self._init_from_config(source, cfg, rank, world_size)  # rows prepared on the CPU
        self._in_rows(self.skips.entries)  # shards dropped before the epoch was planned
        if self.subset is not None:  # a sample here is a block of rows, not a keyed record
            raise ValueError("subsample, keys, exclude and select take samples by key; the "
                             "tabular loader's samples are blocks of rows with no keys of "
                             "their own: filter rows at conversion (make_shards tabular), or "
                             "hold out by hash with the train/eval holdout")
        cuda = self.placement.target == "cuda"
        self.copier = DeviceCopier(("cuda", self.placement.cuda_index) if cuda else "cpu",
                                   None, None, True, slots=cfg.prefetch + 2)
        self.agree_to_stop = rank_agreement(world_size)

    def _plan_args(self, epoch: int) -> dict[str, Any]:
        # The reader reads blocks: read_blocks at a time, shuffled in a buffer of blocks.
        return {**super()._plan_args(epoch), "batch_size": self.read_blocks,
                "shuffle_buffer": self.cfg.block_shuffle_buffer}

    def _batches_per_epoch(self, plan: EpochPlan) -> int | None:
        return None  # rows per rank are known only once read (see __len__)

    def __len__(self) -> int:
        rows = self._rows_per_epoch()
        if rows is None:
            raise TypeError("this tabular loader's length is unknown: it needs one rank "
                            "(ranks read equal blocks, not rows), no holdout, and a source "
                            "whose manifest.json counts its rows")
        return -(-rows // self.batch_size)

    def _rows_per_epoch(self) -> int | None:
        whole = self.info.blocks is not None and self.source.total == self.info.blocks
        if self.world_size != 1 or self.holdout is not None or self._rest or not whole:
            return None
        return self.info.rows

    # -- state: what must match besides the shards ---------------------------------------------

    def _tabular_fields(self) -> dict[str, Any]:
        c = self.cfg
        return {"num_buckets": self._buckets.tolist(), "hash_seed": c.hash_seed,
                "hash_version": hashing.HASH_VERSION, "dense_transform": c.dense_transform,
                "fill": c.fill, "clip": list(c.clip) if c.clip else None,
                "read_blocks": self.read_blocks,
                "block_shuffle_buffer": c.block_shuffle_buffer}

    def _local_state(self) -> dict[str, Any]:
        return {**super()._local_state(), "tabular": self._tabular_fields()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        theirs = state.get("tabular") or {}
        for name, value in self._tabular_fields().items():
            if theirs.get(name) != value:
                raise ValueError(f"loader state does not match this loader; it differs in "
                                 f"{name}: {theirs.get(name)!r} in the state, {value!r} here. "
                                 "Build the loader as it was when the state was saved")
        if "ranks" in state and int(state["world_size"]) != self.world_size:
            raise ValueError(f"this tabular loader state was saved on {state['world_size']} "
                             f"ranks; resume it on {state['world_size']} (a tabular position "
                             "inside a shuffled window resumes on the same number of ranks)")
        super().load_state_dict(state)

    # -- the reader stage: blocks -> windows of rows -----------------------------------------

    def _reads(self, plan: EpochPlan, before: dict[str, Any] | None, stop: threading.Event
               ) -> Generator[tuple[Window, dict[str, Any]], None, None]:
        """(window of a read, reader state after it); `before` is where the reader starts."""
        for enc in self._encoded(plan, before, (BLOCK_EXT,)):
            if stop.is_set():
                return
            self._in_rows(enc.skips)  # the reader's, before _block adds its own (in rows)
            blocks = self._check_each(enc, self._block)
            window = self._window(before, enc, blocks)
            if self.shuffle:
                window.permute(self.seed, plan.epoch)
            yield window, enc.state
            before = enc.state

    def _block(self, enc: EncodedBatch, i: int) -> Block:
        """Block `i` decoded and checked. A block refused costs its rows, not one sample: the
        skip says so, so that rows read + skipped_samples() is the manifest's rows."""
        try:
            block = decode_block(enc.data[i].tobytes())
        except DataError as err:
            raise DataError(err.reason, err.detail, samples=self._lost_block_rows()) from None
        schema = self.info.schema
        if block.dense_names != schema.dense or block.cat_names != schema.categorical:
            raise DataError("schema-mismatch", f"the block holds dense {list(block.dense_names)}"
                            f" and categorical {list(block.cat_names)}; the source's schema is "
                            f"dense {list(schema.dense)}, categorical {list(schema.categorical)}",
                            samples=block.rows)
        return block

    def _in_rows(self, entries: list[dict[str, Any]]) -> None:
        """The readers' skips count what they lose in samples, here blocks (a shard's count in
        the manifest is of its blocks): made rows, as _block's are, so that rows read +
        skipped_samples() is the manifest's rows; unknown where blocks may be short."""
        per = self._lost_block_rows()
        for entry in entries:
            if entry.get("samples") is not None:
                entry["samples"] = entry["samples"] * per if per is not None else None

    def _lost_block_rows(self) -> int | None:
        """The rows of a block that does not decode: rows_per_block where the manifest's
        counts say every block is full; else unknown (None, which skipped_of_unknown_size()
        counts), since the manifest does not say which blocks are short (a part's last, those
        with bad rows left out at conversion)."""
        info = self.info
        if info.rows is not None and info.blocks is not None and \
                info.rows == info.blocks * info.rows_per_block:
            return info.rows_per_block
        return None

    def _window(self, before: dict[str, Any] | None, enc: EncodedBatch,
                blocks: list[Block]) -> Window:
        """The read's blocks as one window of model-ready rows (in read order)."""
        c = self.cfg
        sizes = [b.rows for b in blocks]
        dense = [dense_features.transform(b.dense, c.dense_transform, c.fill, c.clip)
                 for b in blocks]
        sparse = [hashing.bucket_ids(b.cat_blob, b.cat_offsets, b.rows, self._buckets,
                                     self._seeds) for b in blocks]
        d, f = len(self.schema.dense), len(self.schema.categorical)
        return Window(
            before,
            np.concatenate(dense) if blocks else np.zeros((0, d), np.float32),
            np.concatenate(sparse) if blocks else np.zeros((0, f), np.int64),
            np.concatenate([b.label for b in blocks]) if blocks else np.zeros(0, np.float32),
            list(enc.keys),
            np.repeat(np.arange(len(sizes), dtype=np.int32), sizes),
            np.concatenate([np.arange(n, dtype=np.int32) for n in sizes]) if sizes
            else np.zeros(0, np.int32),
            skips=list(enc.skips))

    # -- the batch stage: windows -> batches on the device --------------------------------------

    def _produce(self, plan: EpochPlan, state: dict[str, Any] | None, stop: threading.Event
                 ) -> Iterator[Produced]:
        before = state["reader"] if state else None
        drop = int(state["offset"]) if state else 0
        index = int(state["batches"]) if state else 0
        # Windows are read, decoded and hashed in a stage of their own, `prefetch` windows
        # ahead, and cut into batches in this one: in one thread a window's preparation (a
        # burst of numpy passes, which leave the GIL) would stall the batches it feeds, since
        # a window holds many batches and the queue only `prefetch`.
        reads: Stage[tuple[Window, dict[str, Any]]] = Stage(
            lambda reader_stop: self._reads(plan, before, reader_stop), depth=self.prefetch,
            name="shardflow-tabular-reader", parent_stop=stop)
        windows: Windows[Window] = Windows(self.batch_size)
        cut = functools.partial(rows_of, dense=len(self.schema.dense),
                                fields=len(self.schema.categorical))
        try:
            for n, (window, after) in enumerate(reads):
                if n == 0 and drop:  # resuming inside this read: its first rows went out
                    window.offset, window.reported = drop, True
                windows.add(window, after)
                while windows.ready() and not stop.is_set():
                    yield self._batch(cut(*windows.take()), windows.position(), index)
                    index += 1
            while windows.available or windows.pending_skips():  # the epoch's last batch
                item = self._batch(cut(*windows.take()), windows.position(), index)
                index += item[0] is not None
                yield item
        finally:
            reads.close()

    def _batch(self, cut: Cut, position: tuple[dict[str, Any] | None, int], index: int
               ) -> Produced:
        """A batch, or with no rows (every block of it skipped) an item that only carries the
        skips: a batch of 0 rows would be a step one rank skips and the others take."""
        import torch

        if not len(cut.label):
            return None, {"reader": position[0], "offset": position[1], "batches": index}, \
                None, cut.skips
        (dense, sparse, label), ready = self.copier.move(
            torch.from_numpy(np.ascontiguousarray(cut.dense)),
            torch.from_numpy(np.ascontiguousarray(cut.sparse)),
            torch.from_numpy(np.ascontiguousarray(cut.label)))
        state = {"reader": position[0], "offset": position[1], "batches": index + 1}
        return TabularBatch(dense, sparse, label, cut.keys), state, ready, cut.skips
