"""Parts of a batch's state written out only when the state is used.

Every batch carries its reader's position, and two parts of a position cost time in
proportion to what is in flight: the snapshot of what the rank has read (consumed.py: the keys
of the shards in progress, about a shuffle buffer's worth) and, for packed text, what the read
in progress has used up (text/elastic.py). Written out for every batch they were a tenth of
the text loader's time, yet a position is read only when it is saved (`state_dict`) or a pass
starts from it. So a state holds a `Deferred` there: what is needed to write the part later,
taken at the batch, never changed after. `resolved(state)` writes every such part out, and the
loader calls it where a state leaves it or restarts it, so what anyone else sees is plain
JSON-compatible data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_UNSET = object()


class Deferred:
    """A value computed on first use by `make()` (which must depend only on what it was given
    when the Deferred was made), then kept."""

    __slots__ = ("_make", "_value")

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make: Callable[[], Any] | None = make
        self._value: Any = _UNSET

    def value(self) -> Any:
        # Two threads may resolve one state at once (a checkpoint taken beside the loop):
        # both may compute it (the same value), neither finds `_make` gone before the value
        # is there.
        make = self._make
        if make is not None and self._value is _UNSET:
            self._value = make()
            self._make = None  # what it held can go
        return self._value


def resolved(state: Any) -> Any:
    """`state` with every Deferred in it (in dicts, lists and tuples, at any depth) replaced
    by its value; plain data comes back equal (containers copied)."""
    if isinstance(state, Deferred):
        return resolved(state.value())
    if isinstance(state, dict):
        return {k: resolved(v) for k, v in state.items()}
    if isinstance(state, list):
        return [resolved(v) for v in state]
    if isinstance(state, tuple):
        return tuple(resolved(v) for v in state)
    return state
