"""Mixing datasets by weight: batches drawn from several loaders, one source per batch.

    loader = image_loader([("shards/a", 0.7), ("shards/b", 0.3)], batch_size=64)
    for batch in loader: ...              # 70% of the batches from a, 30% from b, on average
    loader.counts                         # samples per source so far this epoch

Each batch comes whole from one source, drawn by weight from (seed, epoch, batch index)
alone: the same draws on every rank (so ranks stay in step, each reading its own shards of
the drawn source) and after a resume. A batch of one source keeps what its loader gives
(its shuffling, augmentation, padding rules). Drawing per batch rather than per sample keeps
each source's pipeline as it is; the mixture evens out over a few batches.

An epoch of the mixture is `epoch_batches` batches (or `epoch_samples` / batch_size, rounded
up); by default as many as the sources' own epochs hold together (a source drawn more often
than its size starts its next epoch when it runs out: every source cycles through its own
epochs, reshuffled each time). Packed text has no length known ahead: give `epoch_batches`.

`epoch_samples=N` on one source makes it a mixture of that one source: epochs of N samples
(webdataset's `with_epoch`, Streaming's `epoch_size`) that cut the source's epochs, the next
one going on where the last stopped, or wrap them, a longer one running into the source's
next epoch. (A batch is counted as batch_size samples: one with skips counts the same.)

`state_dict()` holds the mixture's epoch and batch and every source loader's own state, so a
resume continues every source exactly; load it into a mixture built the same way.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any, TypeGuard

log = logging.getLogger(__name__)
Mixture = Sequence[tuple[Any, float]]  # [(source, weight), ...]


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
                 epoch_batches=epoch_batches)


def build(make: Callable[[Any], Any], source: Sequence[tuple[Any, float]], *, seed: int,
          epoch_batches: int | None = None) -> MixedLoader:
    """A MixedLoader of `make(one_source)` for each (source, weight) of `source`."""
    names = [_name(src) for src, _ in source]
    if len(set(names)) != len(names):
        raise ValueError(f"a mixture names a source twice: {names}")
    loaders: list[Any] = []
    try:
        for src, _ in source:
            loaders.append(make(src))
    except BaseException:
        for built in loaders:
            built.close()
        raise
    return MixedLoader(loaders, [w for _, w in source], names, seed=seed,
                       epoch_batches=epoch_batches)


def _name(source: Any) -> str:
    if isinstance(source, (str, Path)):
        return str(source)
    return ",".join(str(s) for s in source)


class MixedLoader:
    """Batches of several loaders drawn by weight (see the module docstring)."""

    kind = "mixed"

    def __init__(self, loaders: list[Any], weights: list[float], names: list[str], *,
                 seed: int, epoch_batches: int | None = None) -> None:
        if any(not math.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"mixture weights {weights}: each must be a number above 0")
        self.loaders, self.names, self.seed = loaders, names, seed
        total = sum(weights)
        self.weights = [w / total for w in weights]
        self._bounds = list(accumulate(self.weights))[:-1]
        self.epoch_batches = epoch_batches if epoch_batches is not None else self._default()
        if self.epoch_batches < 1:
            raise ValueError(f"epoch_batches={self.epoch_batches}: need at least 1")
        self.epoch, self._batch = 0, 0
        self._iters: list[Iterator[Any] | None] = [None] * len(loaders)
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

    def source_of(self, index: int, epoch: int | None = None) -> int:
        """Which source batch `index` of `epoch` (default: this one) is drawn from."""
        draw = random.Random(f"mix/{self.seed}/{self.epoch if epoch is None else epoch}/"
                             f"{index}").random()
        return bisect.bisect_right(self._bounds, draw)

    def __iter__(self) -> Iterator[Any]:
        while self._batch < self.epoch_batches:
            which = self.source_of(self._batch)
            batch = self._next(which)
            self._batch += 1
            self.counts[self.names[which]] += len(batch)
            yield batch
        log.info("mixed epoch %d: %s", self.epoch, ", ".join(
            f"{n} samples from {name}" for name, n in self.counts.items()))
        self.epoch, self._batch = self.epoch + 1, 0
        self.last_counts, self.counts = self.counts, dict.fromkeys(self.names, 0)

    def _next(self, which: int) -> Any:
        """The next batch of source `which`; at the end of its epoch, from its next one."""
        for _ in range(2):
            if self._iters[which] is None:
                self._iters[which] = iter(self.loaders[which])
            try:
                return next(self._iters[which])  # type: ignore[arg-type]
            except StopIteration:
                self._iters[which] = None
        raise RuntimeError(f"mixture source {self.names[which]} gave no batch in a whole "
                           "epoch")

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "epoch": self.epoch, "batches": self._batch,
                "seed": self.seed, "names": list(self.names),
                "weights": list(self.weights), "epoch_batches": self.epoch_batches,
                "counts": dict(self.counts),
                "sources": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; ValueError naming what differs from this mixture."""
        if any(it is not None for it in self._iters):
            raise RuntimeError("load_state_dict() while the mixture is being iterated")
        for field in ("kind", "seed", "names", "epoch_batches"):
            if state.get(field) != getattr(self, field):
                raise ValueError(f"mixture state does not match this mixture; it differs in "
                                 f"{field}: {state.get(field)!r} in the state, "
                                 f"{getattr(self, field)!r} here")
        if not all(math.isclose(a, b) for a, b in zip(state["weights"], self.weights,
                                                      strict=True)):
            raise ValueError(f"mixture state has weights {state['weights']}, this mixture "
                             f"{self.weights}")
        for loader, saved in zip(self.loaders, state["sources"], strict=True):
            loader.load_state_dict(saved)
        self.epoch, self._batch = int(state["epoch"]), int(state["batches"])
        self.counts = {**dict.fromkeys(self.names, 0), **state["counts"]}

    # -- what the source loaders report --------------------------------------------------

    @property
    def skipped(self) -> list[dict[str, Any]]:
        return [entry for loader in self.loaders for entry in loader.skipped]

    def skip_counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for loader in self.loaders:
            for reason, n in loader.skip_counts().items():
                total[reason] = total.get(reason, 0) + n
        return total

    def close(self) -> None:
        for i, it in enumerate(self._iters):
            if it is not None:
                getattr(it, "close", lambda: None)()  # ends the source's pass: its stages stop
                self._iters[i] = None
        for loader in self.loaders:
            loader.close()

    def __enter__(self) -> MixedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
