"""One source of a mixture (mix.py): its loader, the batch rows are being taken from, and
where to resume it.

A source's batches are taken in places: each batch is `batch_size` places, whatever it holds
(a batch with skips, or an epoch's short last one, has rows for its first places only). A
mixture asks for places, never rows, so every rank takes each batch of a source at the same
step, whatever its own batches held: ranks stay in step, and so do the votes a packed text
loader takes at the end of its epoch.

Resuming exactly: the state of a source is its loader's own state from before the batch now
being taken from, and how many places of that batch were taken. A resume reads that batch
again and passes over them. On another number of ranks, the loader's own state gives the
rest of its epoch (elastic.py), which still holds the rows taken from each old rank's batch
in hand: their keys are saved beside, and left out when the rest reads them. (A text batch's
rows have no keys of their own: those rows are read again, at most a batch a rank.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from shardflow.loading import rows


class Source:
    """A source loader taken from in places (see the module docstring)."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader, self.name = loader, name
        self.size = int(loader.batch_size)
        self._iter: Iterator[Any] | None = None
        self._batch: Any = None  # the batch rows are being taken from
        self._taken = 0  # ... and the places of it taken
        self._start: dict[str, Any] | None = None  # the loader's state before _batch
        self._start_drop: list[str] = []  # the keys to leave out, as they were then
        self._skip = 0  # places to pass over in the next batch (resumed), and their keys
        self._skip_keys: list[str] = []
        self._drop: set[str] = set()  # keys to leave out (resumed on another number of ranks)

    # -- reading -------------------------------------------------------------------------

    def whole(self) -> Any:
        """The next batch whole (a mixture of whole batches)."""
        return self._next()[0]

    def take(self, places: int) -> list[Any]:
        """The rows of the next `places` places, as pieces of the batches they lie in."""
        pieces = []
        while places:
            if self._batch is None or self._taken == self.size:
                self._fetch()
            n = min(places, self.size - self._taken)
            pieces.append(rows.take(self._batch, self._taken, self._taken + n))
            self._taken += n
            places -= n
        return pieces

    def _fetch(self) -> None:
        start, drop = self.loader.state_dict(gather=False), sorted(self._drop)
        batch, new_epoch = self._next()
        if self._drop and rows.keyed_by_row(batch):
            kept = [i for i, key in enumerate(batch.keys) if key not in self._drop]
            if len(kept) < len(batch):
                self._drop.difference_update(batch.keys)
                batch = rows.pick(batch, kept)
        self._batch, self._start = batch, start
        self._start_drop = [] if new_epoch else drop  # a new epoch has nothing to leave out
        self._taken, self._skip, self._skip_keys = self._skip, 0, []

    def _next(self) -> tuple[Any, bool]:
        """The loader's next batch, from its next epoch when this one is over; and whether
        that was so."""
        for attempt in range(2):
            if self._iter is None:
                self._iter = iter(self.loader)
            try:
                return next(self._iter), attempt > 0
            except StopIteration:
                self._iter = None
                self._drop.clear()  # what was left to leave out was not in this epoch
        raise RuntimeError(f"mixture source {self.name} gave no batch in a whole epoch")

    def close(self) -> None:
        if self._iter is not None:
            getattr(self._iter, "close", lambda: None)()  # ends the loader's pass
            self._iter = None

    # -- state ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Where to resume: the loader's own state (this rank's) and the places taken since."""
        if self._batch is not None and self._taken < self.size:
            taken_rows = min(self._taken, len(self._batch))
            keys = list(self._batch.keys[:taken_rows]) if rows.keyed_by_row(self._batch) \
                else []
            return {"state": self._start, "taken": self._taken, "taken_keys": keys,
                    "drop": self._start_drop}
        return {"state": self.loader.state_dict(gather=False), "taken": self._skip,
                "taken_keys": list(self._skip_keys), "drop": sorted(self._drop)}

    def load(self, state: dict[str, Any], taken: int = 0, taken_keys: list[str] | None = None,
             drop: list[str] | None = None) -> None:
        """Continue from a loader state, passing over `taken` places of its next batch and
        leaving out the keys `drop` in the rest of its epoch. A pass under way is ended."""
        self.close()
        self.loader.load_state_dict(state)
        self._batch, self._taken, self._start = None, 0, None
        self._skip, self._skip_keys = int(taken), list(taken_keys or [])
        self._drop = set(drop or [])
