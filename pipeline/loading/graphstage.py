"""The decode stage of the loaders that decode in a DALI graph (images, point clouds): what
they share, written once. A modality's stage derives from `DecodeCore` (placement, per-thread
settings, the device copier, a bad sample raised or recorded with its batch) and holds its
backend: a `GraphBackend` here (the DALI graph) or portablestage.py's `ThreadBackend` (a pool
of PIL or numpy decodes). The modality supplies its own full check of one sample (`_check`),
the last step to a batch (`_finish`) and what its backend asks for: the graph's `_build`,
`_feed` and `_fetch`, or the threads' `_decode_one` and `_assemble`. Its loader subclasses
`GraphLoader` (the reader stage's checks).

    reader stage items (EncodedBatch, per-sample columns)
      -> GraphBackend: graph up to prefetch + 1 batches ahead, outputs copied out before
         the next run
      -> a failed batch is traced to its samples: the modality's own check of each (PIL,
         numpy), then each alone through a one-sample graph (one, reused until a sample
         fails in it); bad samples are raised or skipped (recorded with the batch) and the
         rest runs again
      -> the stage's _finish(item, output) -> (batch, reader state, ready event, skips)
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from shardflow import dali
from shardflow.errors import DataError, OnError, SkipLog, handle
from shardflow.loading.batch import EncodedBatch
from shardflow.loading.delivery import DeviceCopier
from shardflow.loading.loader import Loader, Produced
from shardflow.loading.options import GraphOptions
from shardflow.loading.prefetch import one_core_in_this_thread
from shardflow.loading.readers import Placement
from shardflow.loading.readplan import EpochPlan
from shardflow.loading.shardlist import Source

# (the encoded batch, then per-sample columns aligned with it: labels, windows, parameters)
Item = tuple[Any, ...]


class Backend(Protocol):
    """What a stage's backend does: the stage's items in, (item, decoded output or None when
    every sample was dropped) out, in order; `close` releases what it holds."""

    def run(self, prepared: Iterable[Item], stop: threading.Event
            ) -> Iterator[tuple[Item, Any]]: ...

    def close(self) -> None: ...


class DecodeCore(ABC):
    """What a modality's decode stage shares on either backend: placement, per-thread
    settings, the device copier, a bad sample raised or recorded with its batch. `run` turns
    the reader stage's items into (batch, reader state, ready event, skips) through
    `self.backend`, which the modality's stage sets."""

    what = "sample"  # as a decoder's refusal names it: "bad-image", "bad-cloud"
    epoch = 0  # the pass being decoded, set by the loader: the user's ops draw from it
    backend: Backend

    def __init__(self, placement: Placement, on_error: OnError, prefetch: int) -> None:
        self.placement, self.on_error, self.prefetch = placement, on_error, prefetch
        # Where decoding runs ("cpu": a DALI graph with device_id=None) and the batches' CUDA
        # index, if any.
        self.decode, self.cuda_index = placement.decode, placement.cuda_index
        self._copier: DeviceCopier | None = None

    def enter_thread(self) -> None:
        """Per-thread settings for the thread that runs this stage."""
        if self.placement.target == "cuda":
            import torch

            torch.cuda.set_device(self.cuda_index)  # new threads start on device 0
        if self.decode == "cpu":
            one_core_in_this_thread()

    def run(self, prepared: Iterable[Item], stop: threading.Event) -> Iterator[Produced]:
        for item, decoded in self.backend.run(prepared, stop):
            if stop.is_set():
                return
            yield self._finish(item, decoded)

    def close(self) -> None:
        self.backend.close()

    @property
    def copier(self) -> DeviceCopier:
        if self._copier is None:
            self._copier = self._make_copier()
        return self._copier

    @abstractmethod
    def _check(self, data: bytes) -> None:
        """Raise DataError when the modality's own decoder refuses one sample's bytes."""

    @abstractmethod
    def _finish(self, item: Item, fetched: Any) -> Produced: ...

    @abstractmethod
    def _make_copier(self) -> DeviceCopier: ...

    def _handle(self, err: DataError, enc: EncodedBatch, i: int) -> None:
        skips = SkipLog()
        handle(err.located(source=enc.urls[i], key=enc.keys[i]), self.on_error, skips)
        enc.skips.extend(skips.entries)


class GraphStage(Protocol):
    """What a GraphBackend asks of its stage: the graph, fed and read, and the checks."""

    what: str

    def _build(self, depth: int, batch_size: int | None = None) -> Any:
        """A built graph running `depth` batches ahead (batch_size: the loader's if None)."""

    def _feed(self, graph: Any, item: Item) -> None: ...

    def _fetch(self, out: Any, item: Item) -> Any:
        """The graph's output copied out of DALI's buffers, before the graph runs again."""

    def _check(self, data: bytes) -> None: ...

    def _handle(self, err: DataError, enc: EncodedBatch, i: int) -> None: ...


class GraphBackend:
    """One stage's DALI graph (through a GraphRunner), and the tracing of a failed batch to
    its samples."""

    def __init__(self, stage: GraphStage, placement: Placement, prefetch: int) -> None:
        self.stage = stage
        # On the CPU the graph runs `prefetch` batches ahead of the one this thread is
        # finishing (resizing it, ~20 ms a batch), so that DALI's threads always have one
        # queued: at 2 in all they sat idle behind the resize (measured on 2 cores, images:
        # 1.10-1.20x more batches a second at prefetch + 1 = 3; --tune tries prefetch 2 and
        # 4). A GPU graph does it all: `prefetch` deep, as before, its memory on the device.
        depth = prefetch + 1 if placement.decode == "cpu" else prefetch
        # The device the graph itself runs on: a CPU-decoding graph takes device_id=None even
        # when its batches go to CUDA (the copier moves them), so that DALI opens no CUDA
        # context of its own and holds no device memory for a graph that never uses it.
        self.graph_device = placement.cuda_index if placement.decode == "gpu" else None
        self.runner = dali.GraphRunner(stage._build, stage._feed, stage._fetch,
                                       lambda item: not len(item[0]), depth=depth)
        # The one-sample graph that traces a failed batch to its samples, kept between
        # samples and batches: on the GPU each build initialises nvJPEG (and allocates), so a
        # fresh one per sample cost up to batch_size of those per failed batch. Rebuilt only
        # after a sample failed in it (DALI may leave a failed graph unusable).
        self._probe: Any = None

    def run(self, prepared: Iterable[Item], stop: threading.Event
            ) -> Iterator[tuple[Item, Any]]:
        for item, fetched in self.runner.run(iter(prepared), self._on_failure):
            if stop.is_set():
                return
            yield item, fetched

    def close(self) -> None:
        self.runner.close()
        self._probe = None

    # -- failures --------------------------------------------------------------------------

    def _on_failure(self, item: Item, exc: Exception) -> Item:
        """Drop (or raise on) the samples that made the batch fail; re-raise if none did."""
        bad = self._refused_by_check(item[0]) or self._rejected_by_dali(item)
        if not bad:
            raise exc
        for i in reversed(bad):
            item[0].drop(i)
            for column in item[1:]:
                del column[i]
        return item

    def _refused_by_check(self, enc: EncodedBatch) -> list[int]:
        bad = []
        for i in range(len(enc)):
            try:
                self.stage._check(enc.data[i].tobytes())
            except DataError as err:
                bad.append(i)
                self.stage._handle(err, enc, i)
        return bad

    def _rejected_by_dali(self, item: Item) -> list[int]:
        """Samples a one-sample graph fails on (DALI refuses what the modality's check read)."""
        enc = item[0]
        bad = []
        for i in range(len(enc)):
            one = (EncodedBatch([enc.keys[i]], [enc.urls[i]], [enc.data[i]], [enc.labels[i]]),
                   *([column[i]] for column in item[1:]))
            if self._probe is None:
                self._probe = self.stage._build(1, batch_size=1)
            try:
                self.stage._feed(self._probe, one)
                self._probe.schedule_run()
                self._probe.outputs()
            except RuntimeError as exc:
                self._probe = None
                bad.append(i)
                self.stage._handle(DataError(self.stage.what, f"DALI cannot decode it: "
                                             f"{dali.reason(exc)}"), enc, i)
        return bad


class GraphLoader(Loader):
    """A loader whose samples go through a reader stage (checks, per-sample parameters) and a
    decode stage (a DecodeCore holding a GraphBackend, or on the portable backend a
    ThreadBackend): the shape of the image and point-cloud loaders. A subclass sets `members`
    (the extensions it reads) and supplies `_check_one` (a sample's label and parameters, or
    a DataError) and `_decode_stage` (for `self.backend`). `extras`: further members the
    readers carry along (EncodedBatch.extras), for `_check_one` to check and parse."""

    members: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()
    # A pipeline's sample stage (compose/samples.py): its batch step (encode) runs here, on
    # what the checks left of each batch.
    fields: Any = None

    def __init__(self, source: Source, cfg: GraphOptions, rank: int, world_size: int) -> None:
        # DALI's graph can decode on a GPU; the portable backend on the CPU only (resolve.py).
        self._init_from_config(source, cfg, rank, world_size, gpu_decode=True)
        classes = self.source.classes
        self.num_classes = cfg.num_classes or (len(classes) if classes else None)
        self._decoder = self._decode_stage()

    @abstractmethod
    def _decode_stage(self) -> DecodeCore: ...

    @abstractmethod
    def _check_one(self, enc: EncodedBatch, i: int, epoch: int) -> tuple[int | None, Any]:
        """(label, or None when the loader reads no labels; the sample's parameters for the
        graph); DataError for a bad sample."""

    def _prepared(self, plan: EpochPlan, state: dict[str, Any] | None,
                  stop: threading.Event) -> Iterator[Item]:
        for enc in self._encoded(plan, state, self.members, self.extras):
            if stop.is_set():
                return
            checked = self._check_each(enc, lambda e, i: self._check_one(e, i, plan.epoch))
            if self.fields is not None:
                self.fields.encode(enc)
            yield enc, [label for label, _ in checked], [param for _, param in checked]

    def _produce(self, plan: EpochPlan, reader_state: dict[str, Any] | None,
                 stop: threading.Event) -> Iterator[Produced]:
        self._decoder.epoch = plan.epoch  # one pass at a time: its ops draw from this epoch
        return self._two_stages(lambda s: self._prepared(plan, reader_state, s),
                                self._decoder, stop)

    def close(self) -> None:
        super().close()
        self._decoder.close()
