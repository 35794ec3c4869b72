"""Mixing datasets by weight: batches drawn from several loaders.

    loader = image_loader([("shards/a", 0.7), ("shards/b", 0.3)], batch_size=64)
    for batch in loader: ...              # each sample from a with chance 0.7, from b 0.3
    loader.counts                         # samples per source so far this epoch

How a batch is drawn (`mixing=`), always from (seed, epoch, batch index) alone: the same
draws on every rank (so ranks stay in step, each reading its own shards of the drawn
sources) and after a resume.
- "sample" (the default): each of the batch's batch_size places is drawn by weight, as
  Streaming's `random` batching, LitData and webdataset's RandomMix do. Over an epoch a
  source's share is within sampling error of its weight.
- "stratified": each batch holds the weights' shares of its places, rounded (each source its
  share rounded down or up, the rounding carried from batch to batch so that the epoch's
  shares are the weights to within a place): Streaming's `stratified`.
- "batch": each batch comes whole from one source drawn by weight, as its loader gives it;
  for sources whose batches cannot share one (other image sizes, other fields).
Per sample, a batch is made of rows of the sources' own batches (rows.py), which keep what
their loaders give them (shuffling, augmentation, padding rules), rows of one source
together, in the sources' order. A source's batch is taken in places, as many as its
batch_size, whatever it holds (mixsource.py): a batch with skips, or a source epoch's short
last one, leaves places empty, so a batch of the mixture can be short, as a loader's can.

An epoch of the mixture is `epoch_batches` batches (or `epoch_samples` / batch_size, rounded
up); by default as many as the sources' own epochs hold together (a source drawn more often
than its size starts its next epoch when it runs out: every source cycles through its own
epochs, reshuffled each time). Packed text has no length known ahead: give `epoch_batches`.

`epoch_samples=N` on one source makes it a mixture of that one source: epochs of N samples
(webdataset's `with_epoch`, Streaming's `epoch_size`) that cut the source's epochs, the next
one going on where the last stopped, or wrap them, a longer one running into the source's
next epoch. (A batch is counted as batch_size samples: one with skips counts the same.)

`state_dict()` holds the mixture's epoch and batch and, for every source, its loader's own
state from before the batch in hand and the places taken from it (mixsource.py): a resume
continues every source exactly; load it into a mixture built the same way. Under
torch.distributed it gathers every rank's (call it on every rank), and it resumes on
another number of ranks too: each source goes on with the rest of its epoch (elastic.py).
"""

from __future__ import annotations

import bisect
import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any, TypeGuard

from shardflow.loading import elastic, rows
from shardflow.loading.mixsource import Source

log = logging.getLogger(__name__)
Mixture = Sequence[tuple[Any, float]]  # [(source, weight), ...]
MIXING = ("sample", "stratified", "batch")


def is_mixture(source: object) -> TypeGuard[Mixture]:
    """Whether `source` is a list of (source, weight) pairs."""
    return isinstance(source, (list, tuple)) and bool(source) and all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], (int, float))
        and not isinstance(item[1], bool) for item in source)


def sources_of(source: Any) -> Mixture:
    """A mixture as it is, or one source as a mixture of itself (epoch_samples)."""
    return source if is_mixture(source) else [(source, 1.0)]


def build_from(loader_fn: Callable[..., Any], source: Sequence[tuple[Any, float]],
               kwargs: dict[str, Any]) -> MixedLoader:
    """What a `*_loader` function does with a mixture: one `loader_fn(source, **kwargs)` per
    source (`epoch_batches` and `epoch_samples` are the mixture's own options)."""
    kwargs = dict(kwargs)
    epoch_batches = kwargs.pop("epoch_batches", None)
    mixing = kwargs.pop("mixing", "sample")
    epoch_samples = kwargs.pop("epoch_samples", None)
    if epoch_samples is not None:
        if epoch_batches is not None:
            raise ValueError("epoch_samples and epoch_batches both set an epoch's length: "
                             "give one")
        if isinstance(epoch_samples, bool) or not isinstance(epoch_samples, int) \
                or epoch_samples < 1:
            raise ValueError(f"epoch_samples={epoch_samples!r}: a whole number of samples, "
                             "at least 1")
        epoch_batches = -(-epoch_samples // int(kwargs["batch_size"]))
    return build(lambda one: loader_fn(one, **kwargs), source, seed=int(kwargs.get("seed", 0)),
                 epoch_batches=epoch_batches, mixing=mixing)


def build(make: Callable[[Any], Any], source: Sequence[tuple[Any, float]], *, seed: int,
          epoch_batches: int | None = None, mixing: str = "sample") -> MixedLoader:
    """A MixedLoader of `make(one_source)` for each (source, weight) of `source`."""
    if mixing not in MIXING:
        raise ValueError(f"mixing={mixing!r}: one of {', '.join(map(repr, MIXING))}")
    names = [_name(src) for src, _ in source]
    if len(set(names)) != len(names):
        raise ValueError(f"a mixture names a source twice: {names}")
    loaders: list[Any] = []
    try:
        for src, _ in source:
            loaders.append(make(src))
        return MixedLoader(loaders, [w for _, w in source], names, seed=seed,
                           epoch_batches=epoch_batches, mixing=mixing)
    except BaseException:
        for built in loaders:
            built.close()
        raise


def _name(source: Any) -> str:
    if isinstance(source, (str, Path)):
        return str(source)
    return ",".join(str(s) for s in source)


class MixedLoader:
    """Batches of several loaders drawn by weight (see the module docstring)."""

    kind = "mixed"

    def __init__(self, loaders: list[Any], weights: list[float], names: list[str], *,
                 seed: int, epoch_batches: int | None = None, mixing: str = "sample") -> None:
        if any(not math.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"mixture weights {weights}: each must be a number above 0")
        self.loaders, self.names, self.seed, self.mixing = loaders, names, seed, mixing
        self._sources = [Source(loader, name) for loader, name in zip(loaders, names,
                                                                      strict=True)]
        self.batch_size = int(loaders[0].batch_size)
        self.rank = int(getattr(loaders[0], "rank", 0))
        self.world_size = int(getattr(loaders[0], "world_size", 1))
        total = sum(weights)
        self.weights = [w / total for w in weights]
        self._bounds = list(accumulate(self.weights))[:-1]
        self.epoch_batches = epoch_batches if epoch_batches is not None else self._default()
        if self.epoch_batches < 1:
            raise ValueError(f"epoch_batches={self.epoch_batches}: need at least 1")
        self.epoch, self._batch = 0, 0
        self._iterating = False
        self._given = [0] * len(loaders)  # places given to each source this epoch
        self.counts = dict.fromkeys(names, 0)  # samples per source this epoch
        self.last_counts: dict[str, int] = {}  # ... in the last finished epoch

    def _default(self) -> int:
        try:
            return sum(len(loader) for loader in self.loaders)
        except TypeError:  # packed text: unknown
            raise ValueError("a mixture of loaders whose length is unknown (packed text) "
                             "needs epoch_batches=N: the batches an epoch of the mixture "
                             "holds") from None

    def __len__(self) -> int:
        return self.epoch_batches

    # -- the draws -------------------------------------------------------------------------

    def source_of(self, index: int, epoch: int | None = None) -> int:
        """mixing="batch": which source batch `index` of `epoch` (default: this one) is drawn
        from."""
        return bisect.bisect_right(self._bounds, self._rng(index, epoch).random())

    def places_of(self, index: int, epoch: int | None = None) -> list[int]:
        """mixing="sample": how many of batch `index`'s places each source has."""
        rng, places = self._rng(index, epoch), [0] * len(self.weights)
        for _ in range(self.batch_size):
            places[bisect.bisect_right(self._bounds, rng.random())] += 1
        return places

    def _rng(self, index: int, epoch: int | None) -> random.Random:
        return random.Random(f"mix/{self.seed}/{self.epoch if epoch is None else epoch}/"
                             f"{index}")

    def _stratified(self) -> list[int]:
        """Each source's share of this batch's places rounded down, and the places left
        over to those furthest behind their share of the epoch so far."""
        size = self.batch_size
        places = [math.floor(w * size) for w in self.weights]
        behind = [w * size * (self._batch + 1) - given - p
                  for w, given, p in zip(self.weights, self._given, places, strict=True)]
        order = sorted(range(len(places)), key=lambda i: (-behind[i], i))
        for i in order[:size - sum(places)]:
            places[i] += 1
        return places

    # -- iterating -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._batch >= self.epoch_batches:
            # Saved after the epoch's last batch, before the next pass began (a trainer
            # checkpointing every step): this pass is the next epoch, as it would have been.
            self._next_epoch()
        self._iterating = True
        try:
            while self._batch < self.epoch_batches:
                batch = self._draw()
                self._batch += 1
                yield batch
        finally:
            self._iterating = False
        self._next_epoch()

    def _next_epoch(self) -> None:
        log.info("mixed epoch %d: %s", self.epoch, ", ".join(
            f"{n} samples from {name}" for name, n in self.counts.items()))
        self.epoch, self._batch, self._given = self.epoch + 1, 0, [0] * len(self._given)
        self.last_counts, self.counts = self.counts, dict.fromkeys(self.names, 0)

    def _draw(self) -> Any:
        if self.mixing == "batch":
            which = self.source_of(self._batch)
            batch = self._sources[which].whole()
            self.counts[self.names[which]] += len(batch)
            return batch
        places = self.places_of(self._batch) if self.mixing == "sample" \
            else self._stratified()
        pieces = []
        for i, (source, n) in enumerate(zip(self._sources, places, strict=True)):
            if n:
                taken = source.take(n)
                self.counts[self.names[i]] += sum(len(piece) for piece in taken)
                self._given[i] += n
                pieces.extend(taken)
        return rows.join(pieces)

    # -- state ------------------------------------------------------------------------------

    def state_dict(self, gather: bool = True) -> dict[str, Any]:
        """The position after the last batch handed out (see the module docstring). Under
        torch.distributed it is gathered from every rank: call it on every rank;
        `gather=False` gives this rank's own, which resumes on this rank alone."""
        local = {"sources": [source.state() for source in self._sources],
                 "counts": dict(self.counts)}
        common = {"kind": self.kind, "mixing": self.mixing, "epoch": self.epoch,
                  "batches": self._batch, "seed": self.seed, "names": list(self.names),
                  "weights": list(self.weights), "epoch_batches": self.epoch_batches,
                  "given": list(self._given), "world_size": self.world_size}
        ranks = elastic.gather(local, self.world_size) if gather else None
        if ranks is None:
            return {**common, "rank": self.rank, **local}
        return {**common, "ranks": [{k: entry[k] for k in ("sources", "counts")}
                                    for entry in ranks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; ValueError naming what differs from this mixture."""
        if self._iterating:
            raise RuntimeError("load_state_dict() while the mixture is being iterated")
        state = _upgrade(state)
        for field in ("kind", "mixing", "seed", "names", "epoch_batches"):
            if state.get(field) != getattr(self, field):
                raise ValueError(f"mixture state does not match this mixture; it differs in "
                                 f"{field}: {state.get(field)!r} in the state, "
                                 f"{getattr(self, field)!r} here")
        if not all(math.isclose(a, b) for a, b in zip(state["weights"], self.weights,
                                                      strict=True)):
            raise ValueError(f"mixture state has weights {state['weights']}, this mixture "
                             f"{self.weights}")
        mine = self._load_sources(state)
        self.epoch, self._batch = int(state["epoch"]), int(state["batches"])
        self._given = [int(n) for n in state.get("given") or [0] * len(self._sources)]
        self.counts = {**dict.fromkeys(self.names, 0), **mine["counts"]}

    def _load_sources(self, state: dict[str, Any]) -> dict[str, Any]:
        """Load each source's part of `state`; returns this rank's entry (or the nearest)."""
        if "ranks" not in state:
            for field in ("world_size", "rank"):
                if int(state[field]) != getattr(self, field):
                    raise ValueError(f"mixture state of rank {state['rank']} of "
                                     f"{state['world_size']} (saved with gather=False) loads "
                                     f"only there; this is rank {self.rank} of "
                                     f"{self.world_size}")
            for source, part in zip(self._sources, state["sources"], strict=True):
                source.load(part["state"], part["taken"], part["taken_keys"], part["drop"])
            return state
        ranks, same = state["ranks"], int(state["world_size"]) == self.world_size
        for i, source in enumerate(self._sources):
            parts = [entry["sources"][i] for entry in ranks]
            whole = elastic.merge_states([part["state"] for part in parts])
            if same:
                part = parts[self.rank]
                source.load(whole, part["taken"], part["taken_keys"], part["drop"])
            else:
                source.load(whole, drop=sorted({k for part in parts
                                                for k in part["taken_keys"] + part["drop"]}))
        return ranks[min(self.rank, len(ranks) - 1)]

    # -- what the source loaders report --------------------------------------------------

    @property
    def skipped(self) -> list[dict[str, Any]]:
        return [entry for loader in self.loaders for entry in loader.skipped]

    def skip_counts(self) -> dict[str, int]:
        return _summed(loader.skip_counts() for loader in self.loaders)

    def filtered_counts(self) -> dict[str, int]:
        return _summed(loader.filtered_counts() for loader in self.loaders)

    def describe(self) -> dict[str, Any]:
        """The first source's loader's stages (every source's is built alike) and the
        sources by name."""
        return {**self.loaders[0].describe(), "sources": list(self.names)}

    def close(self) -> None:
        for source in self._sources:
            source.close()  # ends the source's pass: its stages stop
        for loader in self.loaders:
            loader.close()

    def __enter__(self) -> MixedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One whole state from every rank's own (`state_dict(gather=False)`, in any order), of
    a mixture or a loader (elastic.merge_states): what `state_dict()` gathers under
    torch.distributed. This is `shardflow.merge_states`."""
    if states and states[0].get("kind") == "pipeline":  # compose/pipeline.py: its loader's
        if any(s.get("pipeline") != states[0]["pipeline"] for s in states):
            raise ValueError("merge_states: the ranks' pipelines differ in their fields or "
                             "steps")
        return {**states[0], "loader": merge_states([s["loader"] for s in states])}
    if not states or states[0].get("kind") != MixedLoader.kind or "ranks" in states[0]:
        return elastic.merge_states(states)
    world = int(states[0]["world_size"])
    by_rank = {int(s["rank"]): s for s in states}
    if sorted(by_rank) != list(range(world)) or len(states) != world:
        raise ValueError(f"merge_states needs one mixture state of each of ranks "
                         f"0..{world - 1}; got ranks {sorted(int(s['rank']) for s in states)}")
    common = {k: v for k, v in states[0].items() if k not in _RANK_FIELDS}
    for s in states[1:]:
        for k, v in common.items():
            if s.get(k) != v:
                raise ValueError(f"merge_states: ranks differ in {k}: {s.get(k)!r} against "
                                 f"{v!r}")
    return {**common, "ranks": [{k: by_rank[r][k] for k in ("sources", "counts")}
                                for r in range(world)]}


_RANK_FIELDS = ("rank", "sources", "counts")


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """The sources' counts (by skip reason, or by filter) added up."""
    total: Counter[str] = Counter()
    for one in counts:
        total.update(one)
    return dict(total)


def _upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A state saved before mixtures drew per sample (no "mixing"): whole batches, and each
    source's own state_dict() as it was (whole, every rank's: merge_states keeps it)."""
    if "mixing" in state:
        return state
    world = int(state["sources"][0].get("world_size", 1))
    parts = [{"state": s, "taken": 0, "taken_keys": [], "drop": []} for s in state["sources"]]
    rest = {k: v for k, v in state.items() if k not in ("sources", "counts")}
    return {**rest, "mixing": "batch", "world_size": world,
            "ranks": [{"sources": parts, "counts": state.get("counts", {})}] * world}
