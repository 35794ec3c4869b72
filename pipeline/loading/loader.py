"""The `Loader`: one rank's batches, epoch after epoch, resumable, with one API for every
modality. A modality supplies `_produce(plan, reader_state, stop)`, the batches of one epoch
each paired with the reader's position after it (a few at a time as a prefetch.Burst, where
they come out together); the Loader runs it in a background stage,
counts epochs and batches, and saves and restores the position.

    for epoch in range(epochs):      # each pass over the loader is one epoch; the next pass
        for batch in loader: ...     # reshuffles (or call set_epoch(e) yourself)
    state = loader.state_dict()      # mid-epoch: a new loader + load_state_dict continues

Passes: a training loader (train=True) left mid-epoch (a break) continues that epoch on the
next pass, as a resume would; an evaluation loader (train=False) starts every pass at the
beginning, so that a validation cut short (a sanity check) never shortens the next one,
except the first pass after load_state_dict, which continues from the state.

A Loader is a torch IterableDataset: `DataLoader(loader, batch_size=None)` hands its batches
on as they are. DataLoader worker processes are neither needed nor allowed: the loader already
reads, decodes and copies in background threads (and DALI's), and each worker would read the
whole epoch again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from shardflow.errors import DataError, Filtered, OnError, SkipLog, handle
from shardflow.loading import consumed, elastic, reader_dali
from shardflow.loading.batch import EncodedBatch
from shardflow.loading.deferred import resolved
from shardflow.loading.holdout import KeyHoldout, select
from shardflow.loading.options import LoaderOptions
from shardflow.loading.prefetch import Burst, Stage
from shardflow.loading.reader_stream import StreamOptions
from shardflow.loading.readplan import EpochPlan, plan_epoch, plan_rest
from shardflow.loading.settled import Settled
from shardflow.loading.shardcache import ShardCache
from shardflow.loading.shardlist import Source
from shardflow.loading.subset import Subset, subset_of

log = logging.getLogger(__name__)
STATE_VERSION = 1
T = TypeVar("T")
# (batch, reader state after it, CUDA event the batch is ready at or None, samples skipped
# on the way to it): skips are committed when the batch is handed out, so that a batch read
# ahead but never consumed is not counted, and a resumed loader counts each skip once.
Produced = tuple[Any, dict[str, Any], Any, list[dict[str, str]]]


class Loader(IterableDataset, ABC):  # type: ignore[type-arg]
    """Iterable over batches on the target device; a context manager; `state_dict()`."""

    kind = "base"
    holdout: KeyHoldout | None = None  # read one side of a split by key hash (holdout.py)
    subset: Subset | None = None  # part of the dataset, by key (subset.py)
    left_out = 0  # samples the subset left out so far (counted as read, re-reads included)
    stream = StreamOptions()  # how the streaming reader fetches (set from the options)
    settled = Settled()  # which options its `*_loader` function filled in, and why (settled.py)

    def __init__(self, source: Source, *, batch_size: int, seed: int, rank: int,
                 world_size: int, shuffle: bool, shuffle_buffer: int, on_error: OnError,
                 prefetch: int, reader: str, timeout_s: float | None = None,
                 backend: str = "dali") -> None:
        self.source, self.batch_size, self.seed = source, batch_size, seed
        self.backend = backend  # "dali" or "portable", resolved; a state is tied to it
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.shuffle_buffer, self.on_error, self.prefetch = shuffle_buffer, on_error, prefetch
        self.reader, self.timeout_s = reader, timeout_s
        self.epoch, self._batches_done = 0, 0
        self._reader_state: dict[str, Any] | None = None
        # The rest of an epoch resumed on another number of ranks (elastic.py): planned by
        # plan_rest while self.epoch is its epoch.
        self._rest: dict[str, Any] | None = None
        self.skips = SkipLog()
        self._stage: Stage[Produced] | None = None
        # DALI's reader for the next pass, started as this one's reads end (reader_dali.py)
        self._primed = reader_dali.Primed()
        self._closed = False
        self._restored = False  # load_state_dict since the last pass: continue from it
        # Set by modalities whose ranks may hold different numbers of batches in an epoch
        # (packed text): called with "I have a batch" before each one, False at the end;
        # returns whether every rank has one (see agreement.rank_agreement).
        self.agree_to_stop: Callable[[bool], bool] | None = None
        plan_epoch(**self._plan_args(0))  # fail at build time, not mid-run, on a bad split

    def _init_from_config(self, source: Source, cfg: LoaderOptions, rank: int,
                          world_size: int, gpu_decode: bool = False) -> None:
        """The construction every modality shares, from its options: the backend, placement
        and reader decided once (resolve.py), then the epochs' plan and position."""
        from shardflow.loading.resolve import resolve

        decided = resolve(self.kind, source, cfg, gpu_decode)
        self.placement = decided.placement
        self.device, self.decode = decided.placement.device, decided.placement.decode
        self.cuda_index = decided.placement.cuda_index
        Loader.__init__(self, decided.source, batch_size=cfg.batch_size, seed=cfg.seed,
                        rank=rank, world_size=world_size,
                        shuffle=cfg.train if cfg.shuffle is None else cfg.shuffle,
                        shuffle_buffer=cfg.shuffle_buffer, on_error=cfg.on_error,
                        prefetch=cfg.prefetch, reader=decided.reader, timeout_s=cfg.timeout_s,
                        backend=decided.backend)
        if rank == 0:  # a shard dropped before the rank split is counted once, by rank 0
            self.skips.extend(decided.dropped)
        self.subset = subset_of(cfg.seed, cfg.subsample, cfg.keys, cfg.exclude, cfg.select)
        self.holdout = cfg.holdout
        cache = ShardCache(cfg.cache_dir, cfg.cache_limit) if cfg.cache_dir else None
        self.stream = StreamOptions(cfg.shards_in_flight, cache)

    # -- epochs ----------------------------------------------------------------------------

    def _plan_args(self, epoch: int) -> dict[str, Any]:
        return {"source": self.source, "epoch": epoch, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "shuffle_buffer": self.shuffle_buffer}

    def plan(self, epoch: int | None = None) -> EpochPlan:
        epoch = self.epoch if epoch is None else epoch
        return _plan(self._plan_args(epoch), self._rest)

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning on the next iteration (no-op if already there)."""
        self._not_iterating("set_epoch")
        if epoch != self.epoch:
            self.epoch, self._batches_done, self._reader_state = epoch, 0, None
            self._rest = None
            self._primed.clear()

    def _next_epoch(self) -> None:
        self.epoch, self._batches_done, self._reader_state = self.epoch + 1, 0, None
        self._rest = None  # the next epoch is whole, on this rank count

    def __len__(self) -> int:
        """Batches in an epoch. In the rest of an epoch resumed on another number of ranks
        (which counts the batches the saved ranks had run, plus its own), the larger of that
        and a whole epoch's: a trainer that asks len() once and stops there (Lightning) then
        runs this epoch and the next ones each to the loader's own end."""
        batches = self._batches_per_epoch(plan_epoch(**self._plan_args(self.epoch)))
        now = self._epoch_length(self.plan(), self._rest)
        if batches is not None and now is not None:
            batches = max(batches, now)
        if batches is None:
            raise TypeError("this loader's length is unknown: its shards have no sample counts "
                            "(read a folder with manifest.json)")
        return batches

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("the loader is closed")
        if self._stage is not None:
            raise RuntimeError("the loader is already being iterated; finish or close that "
                               "iteration first")
        if get_worker_info() is not None:
            raise RuntimeError("a shardflow loader in a DataLoader worker process: use "
                               "DataLoader(loader, batch_size=None) with num_workers=0 (the "
                               "loader reads and decodes in its own threads; every worker "
                               "would read the whole epoch again)")
        if not self.shuffle and not self._restored:
            # An evaluation pass starts at its epoch's beginning (module docstring), whole:
            # not the rest of one resumed on another number of ranks.
            self._batches_done, self._reader_state, self._rest = 0, None, None
        self._restored = False
        batches = self._epoch_length(self.plan(), self._rest)
        if batches is not None and self._batches_done >= batches:
            # Saved after the epoch's last batch, before the next pass began: start that pass.
            self._next_epoch()
        # a position within the epoch, or the rest of one resumed on another number of ranks
        resumed = self._reader_state is not None or self._rest is not None
        yielded = yield from self._pass()
        if resumed and not yielded and self._reader_state is None and self._batches_done == 0:
            # Resumed at the very end of an epoch whose length was unknown (packed text): that
            # pass had nothing left, so this one is the next epoch, as it would have been.
            yield from self._pass()

    def _pass(self) -> Generator[Any, None, int]:
        """One pass over the current epoch from the saved position; returns batches yielded."""
        plan, state = self.plan(), resolved(self._reader_state)
        self._report(plan)
        stage: Stage[Produced] = Stage(lambda stop: self._checked(plan, state, stop),
                                       depth=self.prefetch, name=f"shardflow-{self.kind}",
                                       timeout_s=self.timeout_s)
        self._stage, yielded, voted = stage, 0, False
        try:
            cut_short = False
            for batch, reader_state, ready, skipped in stage:
                if batch is not None and self.agree_to_stop is not None \
                        and not self.agree_to_stop(True):
                    cut_short = voted = True  # another rank has run out: stop with it
                    break
                # Skips are committed when their batch is handed out (or, for skips met after
                # the last batch, with an item that carries no batch and takes no vote).
                self._reader_state = reader_state
                self.skips.extend(skipped)
                if batch is None:
                    continue
                if ready is not None:
                    _wait(ready, batch)
                batch = self._delivered(batch, plan.epoch)
                self._batches_done, yielded = self._batches_done + 1, yielded + 1
                yield batch
            if stage.completed and self.agree_to_stop is not None:
                voted = True
                self.agree_to_stop(False)  # the other ranks' next call learns it
            if cut_short:
                log.warning("epoch %d: rank %d stops after %d batches, where the shortest rank "
                            "ran out; the rest of its data is left out this epoch", self.epoch,
                            self.rank, self._batches_done)
            if stage.completed or cut_short:  # not when close() ended the pass early
                self._next_epoch()
        except Exception:
            if self.agree_to_stop is not None and not voted:
                # This rank is failing: tell the others its data ended, rather than leave them
                # waiting in the all-reduce until the group's timeout.
                with contextlib.suppress(Exception):
                    self.agree_to_stop(False)
            raise
        finally:
            stage.close()
            self._stage = None
        return yielded

    def _delivered(self, batch: Any, epoch: int) -> Any:
        """A batch of `epoch` as the consumer gets it, once delivered and waited for (on the
        consumer's stream); the image loader runs a GPU loader's ops here."""
        return batch

    def _checked(self, plan: EpochPlan, state: dict[str, Any] | None,
                 stop: threading.Event) -> Iterator[Produced | Burst]:
        """`_produce`, refusing a whole epoch of skipped samples (checked on passes that start
        at the epoch's beginning: a resumed pass has not seen what came before its state)."""
        produced = self._produce(plan, state, stop)
        if state is not None:
            return produced
        where = f" on rank {self.rank}" if self.world_size > 1 else ""
        return _not_all_skipped(produced, f"epoch {plan.epoch}{where}")

    def _report(self, plan: EpochPlan) -> None:
        # At the start of an epoch's reading (no reader position yet): also the start of the
        # rest of an epoch resumed on another number of ranks, whose batch count does not
        # start at 0 (it counts the batches the saved ranks had run).
        if plan.dropped and self._reader_state is None:
            log.warning("epoch %d: each of %d ranks reads %s samples; %d samples are left out "
                        "this epoch so that every rank runs the same number of batches",
                        plan.epoch, plan.world_size, plan.length, plan.dropped)

    def _two_stages(self, prepared: Callable[[threading.Event], Iterator[Any]], decoder: Any,
                    stop: threading.Event) -> Iterator[Produced]:
        """The reader stage (`prepared`, in its own thread) feeding `decoder.run` in this one:
        the shape of the image and point-cloud loaders."""
        decoder.enter_thread()
        reader = Stage(prepared, depth=self.prefetch, name=f"shardflow-{self.kind}-reader",
                       parent_stop=stop)
        try:
            yield from decoder.run(reader, stop)
        finally:
            reader.close()

    def _check_each(self, enc: EncodedBatch, check: Callable[[EncodedBatch, int], T]
                    ) -> list[T]:
        """`check(enc, i)` for every sample of `enc`: those it refuses with a DataError are raised
        or dropped from `enc` (the skips recorded with it), those a pipeline's filter leaves
        out are dropped (counted with it); the results of the rest, aligned with what is
        left in `enc`."""
        self._leave_out(enc)
        results: list[T] = []
        skips = SkipLog()
        for i in reversed(range(len(enc))):
            try:
                results.append(check(enc, i))
            except DataError as err:
                handle(err.located(source=enc.urls[i], key=enc.keys[i]), self.on_error, skips)
                enc.drop(i)
            except Filtered as left_out:
                enc.skips.append(left_out.entry(enc.urls[i], enc.keys[i]))
                enc.drop(i)
        enc.skips.extend(reversed(skips.entries))
        return results[::-1]

    def _leave_out(self, enc: EncodedBatch) -> None:
        """Drop the samples of the holdout's other side and those the subset does not take:
        not read, not skipped (the subset's counted in left_out)."""
        select(self.holdout, enc)
        if self.subset is not None:
            self.left_out += self.subset.apply(enc)

    def _encoded(self, plan: EpochPlan, state: dict[str, Any] | None, exts: tuple[str, ...],
                 extras: tuple[str, ...] = (), views: bool = True) -> Iterator[EncodedBatch]:
        """The reader's batches of `plan` from `state` (readers.encoded); once all are read,
        DALI's reader of the next epoch is started for the next pass, which is that epoch
        from its start unless a pass is left early or a state loaded (then it is dropped)."""
        from shardflow.loading import readers

        return readers.encoded(self.reader, plan, state, self.on_error, exts, extras,
                               self.stream, primed=self._primed,
                               then=lambda: plan_epoch(**self._plan_args(plan.epoch + 1)),
                               views=views)

    def _batches_per_epoch(self, plan: EpochPlan) -> int | None:
        """How many batches an epoch yields, when that is known before reading it."""
        return plan.batches

    def _epoch_length(self, plan: EpochPlan, rest: dict[str, Any] | None) -> int | None:
        """Batches of the epoch `plan` reads; for the rest of an epoch resumed on another
        number of ranks, counting the batches the saved ranks had run (so that a trainer's
        batch count within the epoch, restored from the same checkpoint, ends with it)."""
        batches = self._batches_per_epoch(plan)
        if batches is None or not plan.rest or not rest:
            return batches
        return batches + int(rest.get("batches_before", 0))

    @abstractmethod
    def _produce(self, plan: EpochPlan, reader_state: dict[str, Any] | None,
                 stop: threading.Event) -> Iterator[Produced | Burst]:
        """The batches of `plan`'s epoch from `reader_state` on (None: from the start)."""

    # -- state -----------------------------------------------------------------------------

    def state_dict(self, gather: bool = True) -> dict[str, Any]:
        """The position after the last batch handed out: JSON-compatible, credential-free
        (shard URLs appear only as a fingerprint), with every skip so far.

        A whole state holds every rank's position and resumes on any rank and any number of
        ranks (elastic.py). Under torch.distributed it is gathered from all ranks, so call it
        on every rank (as Lightning and tools/train.py do); `gather=False` gives this rank's
        own, which `shardflow.merge_states` joins, and which resumes on this rank alone.
        """
        local = self._local_state()
        states = elastic.gather(local, self.world_size) if gather else None
        return elastic.merge_states(states) if states is not None else local

    def _local_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "kind": self.kind, "source": self.source.describe(),
                "source_fingerprint": self.source.fingerprint(), "world_size": self.world_size,
                "rank": self.rank, "seed": self.seed, "backend": self.backend,
                "reader": self.reader,
                "batch_size": self.batch_size, "shuffle": self.shuffle,
                "shuffle_buffer": self.shuffle_buffer, "epoch": self.epoch,
                "batches": self._batches_done, "reader_state": resolved(self._reader_state),
                "skipped": list(self.skips.entries), "rest": self._rest,
                "filtered": dict(self.skips.filtered),
                "subset": self.subset.describe() if self.subset is not None else None,
                "holdout": None if self.holdout is None else
                {"side": self.holdout.side, "percent": self.holdout.percent}}

    # backend before reader: a portable loader streams, and the backend is what to change.
    _MUST_MATCH = ("version", "kind", "source_fingerprint", "seed", "backend", "reader",
                   "batch_size", "shuffle", "shuffle_buffer", "subset")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; raises ValueError naming what differs from this loader. A
        whole state (with every rank's position) loads on any rank at any world size; a
        rank's own state only on that rank at that world size."""
        self._not_iterating("load_state_dict")
        self._check_matches(state)
        self._primed.clear()
        if "ranks" not in state:
            for field in ("world_size", "rank"):
                self._check_field(state, field, getattr(self, field))
            self._load_entry(state, list(state.get("skipped", [])))
        elif int(state["world_size"]) == self.world_size:
            entry = state["ranks"][self.rank]
            self._load_entry(entry, list(entry.get("skipped") or []))
        else:
            self._load_elsewhere(state)
        self._restored = True

    def _check_matches(self, state: dict[str, Any]) -> None:
        # States saved before there was a portable backend were DALI's: they lack the field.
        state = {"backend": "dali", **state}
        if state["backend"] != self.backend:
            raise ValueError(_other_backend(state["backend"], self.backend))
        mine = self._local_state()
        # States saved before the holdout was recorded lack it: not checked there.
        for field in self._MUST_MATCH + (("holdout",) if "holdout" in state else ()):
            self._check_field(state, field, mine[field])

    @staticmethod
    def _check_field(state: dict[str, Any], field: str, mine: Any) -> None:
        if state.get(field) != mine:
            what = "the shards (their names or counts)" if field == "source_fingerprint" \
                else f"{field}: {state.get(field)!r} in the state, {mine!r} here"
            if field == "reader":  # "auto" may choose another reader than it did then
                what += f" (build it with reader={state.get(field)!r})"
            raise ValueError(f"loader state does not match this loader; it differs in "
                             f"{what}. Build the loader as it was when the state was saved")

    def _load_entry(self, entry: dict[str, Any], skipped: list[dict[str, Any]]) -> None:
        self.epoch, self._batches_done = int(entry["epoch"]), int(entry["batches"])
        self._reader_state, self._rest = entry["reader_state"], entry.get("rest")
        self.skips.entries = skipped
        self.skips.filtered = Counter(entry.get("filtered") or {})

    def _load_elsewhere(self, state: dict[str, Any]) -> None:
        """A whole state saved at another world size: continue with the rest of its epoch
        split over this world's ranks (elastic.py)."""
        old = int(state["world_size"])
        epoch, rest = elastic.rest_of_epoch(
            state["ranks"], lambda entry: self._finished(entry, old), self._consumed_of)
        # The batches the saved ranks had run count as this epoch's first (they step together).
        before = max((int(e["batches"]) for e in state["ranks"] if int(e["epoch"]) == epoch),
                     default=0) if rest else 0
        if rest is not None:
            rest["batches_before"] = before
        self.epoch, self._batches_done, self._reader_state = epoch, before, None
        self._rest = rest
        self.skips.entries = elastic.skips_for(self.rank, state["ranks"])
        self.skips.filtered = Counter()
        if self.rank == 0:  # as the skips: rank 0 carries on the count of every saved rank
            for entry in state["ranks"]:
                self.skips.filtered.update(entry.get("filtered") or {})
        plan = self.plan()  # fails here, not mid-run, when the rest cannot be split
        log.info("loader state saved on %d ranks resumed on %d: epoch %d continues with %s "
                 "samples on this rank", old, self.world_size, epoch,
                 plan.length if rest else "all its")

    def _finished(self, entry: dict[str, Any], world_size: int) -> bool:
        """Whether a saved rank (of `world_size`) had handed out its whole epoch."""
        if entry.get("reader_state") is None:
            return False
        # Rank 0's plan: every rank of a plan reads the same length.
        args = {**self._plan_args(int(entry["epoch"])), "rank": 0, "world_size": world_size}
        rest = entry.get("rest")
        batches = self._epoch_length(_plan(args, rest), rest)
        return batches is not None and int(entry["batches"]) >= batches

    def _consumed_of(self, entry: dict[str, Any]) -> list[dict[str, Any] | None]:
        """What a saved rank's entry says it had read (consumed.py): its reader's snapshot."""
        reader_state = entry.get("reader_state")
        return [reader_state.get("consumed") if reader_state else None]

    def _not_iterating(self, what: str) -> None:
        if self._stage is not None:
            raise RuntimeError(f"{what}() while the loader is being iterated; call it between "
                               "passes")

    @property
    def fetch_stats(self) -> Any:
        """What the streaming reader fetched so far (remote bytes and shards, cache hits):
        fetch.FetchStats."""
        return self.stream.stats

    # -- skips and lifetime ----------------------------------------------------------------

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """Every skip so far (shard URL, key, reason, detail, samples it stands for)."""
        return list(self.skips.entries)

    def skipped_samples(self) -> int:
        """Samples skipped so far, so that `read + skipped_samples() == total`: a shard lost
        whole stands for its count when manifest.json gives one. Skips of unknown size (a
        shard without a count) are left out here: see `skipped_of_unknown_size()`."""
        return self.skips.samples()

    def skipped_of_unknown_size(self) -> int:
        """Skips whose sample count is unknown (shards, or their rest, without a count in
        manifest.json); while this is nonzero, `read + skipped_samples()` falls short."""
        return self.skips.unknown_size()

    def skip_counts(self) -> dict[str, int]:
        return self.skips.counts()

    def filtered_counts(self) -> dict[str, int]:
        """Samples a pipeline's filter (or a map returning None) left out so far, by stage;
        not skips: `read + skipped_samples() + filtered == total`."""
        return dict(sorted(self.skips.filtered.items()))

    def close(self) -> None:
        if self._stage is not None:
            self._stage.close()
            self._stage = None
        self._primed.close()
        self._closed = True

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plan(args: dict[str, Any], rest: dict[str, Any] | None) -> EpochPlan:
    """The plan of the epoch `args` name: the rest of it when `rest` (the rest of an epoch
    resumed on another number of ranks, elastic.py) is of that epoch, else the whole."""
    if rest is not None and int(rest["epoch"]) == args["epoch"]:
        done, partial = consumed.union([rest["consumed"]])
        return plan_rest(**args, done=done, partial=partial, consumed=rest["consumed"])
    return plan_epoch(**args)


def _other_backend(saved: str, here: str) -> str:
    return (f"loader state was saved by the {saved!r} backend and this loader uses {here!r}: "
            "a state is tied to its backend (the backends decode within resampling noise of "
            "each other, and read with different readers), so resuming on the other would not "
            f"continue exactly. Build the loader with backend={saved!r}"
            + (" (install nvidia-dali-cuda120 where it is missing)" if saved == "dali" else ""))


def _wait(ready: Any, batch: Any) -> None:
    """The consumer's side of the stream contract (pipeline/loading/delivery.py)."""
    import torch

    fields = [v for value in vars(batch).values()  # views: a list; targets: a dict
              for v in (value if isinstance(value, list) else
                        value.values() if isinstance(value, dict) else [value])]
    tensors = [v for v in fields if isinstance(v, torch.Tensor) and v.is_cuda]
    if not tensors:
        return
    # The current stream of the batch's device (not of whichever device is current here).
    stream = torch.cuda.current_stream(tensors[0].device)
    stream.wait_event(ready)  # a GPU-side wait for the side stream's copies: no host sync
    for value in tensors:
        # Allocated on the side stream, used on this one: the caching allocator must not
        # hand the block to the side stream's next batch while this stream still reads it.
        value.record_stream(stream)


def _not_all_skipped(produced: Iterator[Produced | Burst], epoch: str
                     ) -> Iterator[Produced | Burst]:
    """`produced`, then a DataError if not one sample came through and some were skipped: an
    epoch of empty batches would pass for a finished one (a run "trains" on nothing). A
    pipeline's filter leaving out a whole epoch is its choice, not a loss: no error alone."""
    read, skipped, filtered = 0, list[dict[str, str]](), 0
    try:
        for item in produced:
            for batch, _state, _ready, skips in item if isinstance(item, Burst) else [item]:
                read += len(batch) if batch is not None else 0
                skipped += [s for s in skips if "filtered" not in s]
                filtered += sum("filtered" in s for s in skips)
            yield item
    finally:  # closed early (a break, close()): the stages below stop now, not when collected
        getattr(produced, "close", lambda: None)()
    if skipped and not read:
        counts = ", ".join(f"{n} {reason}" for reason, n in
                           sorted(Counter(e["reason"] for e in skipped).items()))
        first = skipped[0]
        where = first["source"] + (f" key {first['key']!r}" if first["key"] else "")
        also = f" (and {filtered} left out by filters)" if filtered else ""
        raise DataError("all-skipped", f"every sample of {epoch} was skipped: {counts}{also}; "
                        f"the first, {where}: {first['detail']}", samples=0)
