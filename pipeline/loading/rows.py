"""Rows of a final batch (batch.py's dataclasses): cut, joined and left out, field by field.

A mixture drawing per sample (mix.py) builds each batch from rows of its sources' batches.
Every field of a batch is one of: a tensor or array of N rows, a list of N values (keys, an
extras column), a list of tensors of N rows each (views), a dict of any of these (extras,
targets), or None. That is all this module needs to know about a batch, so it serves the
image, text and point-cloud batches alike.

The one field that is not a row each is a text batch's `keys` (the documents that gave tokens
to its rows, batch.TextBatch): a cut takes them whole with the batch's first row, so each is
handed out once.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any


def keyed_by_row(batch: Any) -> bool:
    """Whether `batch.keys` names its rows one by one (not a text batch's documents)."""
    from shardflow.loading.batch import TextBatch

    return not isinstance(batch, TextBatch)


def take(batch: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of `batch` (as many of them as it has): the batch itself when that
    is all of it."""
    n = len(batch)
    start, stop = min(start, n), min(stop, n)
    if start == 0 and stop == n:
        return batch
    _not_ragged(batch)
    cut = {f.name: _cut(getattr(batch, f.name), start, stop) for f in fields(batch)}
    if not keyed_by_row(batch):
        cut["keys"] = list(batch.keys) if start == 0 else []
    return replace(batch, **cut)


def pick(batch: Any, index: list[int]) -> Any:
    """The rows of `batch` at `index`, in that order."""
    _not_ragged(batch)
    out = {f.name: _pick(getattr(batch, f.name), index) for f in fields(batch)}
    return replace(batch, **out)


def join(pieces: list[Any]) -> Any:
    """One batch of the rows of `pieces`, in order; ValueError when their fields do not fit
    together (other image sizes, a field one source has and another not)."""
    if len(pieces) == 1:
        return pieces[0]
    _not_ragged(pieces[0])
    first = pieces[0]
    out = {}
    for f in fields(first):
        out[f.name] = _join([getattr(piece, f.name) for piece in pieces], f.name)
    return replace(first, **out)


def _not_ragged(batch: Any) -> None:
    """A batch of scenes (batch.ScanBatch) has rows per point, not per sample: refused."""
    from shardflow.loading.batch import ScanBatch

    if isinstance(batch, ScanBatch):
        raise ValueError("mixing per sample: batches of scenes labelled per point are ragged "
                         "(points, not samples, are their rows); mix them with "
                         "mixing='batch'")


def _is_rows(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "__getitem__")


def _is_row_tensors(value: Any) -> bool:  # views: one tensor of N rows per view
    return isinstance(value, list) and bool(value) and all(_is_rows(v) for v in value)


def _cut(value: Any, start: int, stop: int) -> Any:
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: _cut(v, start, stop) for k, v in value.items()}
    if _is_row_tensors(value):
        return [v[start:stop] for v in value]
    return value[start:stop]  # a tensor, an array or a list of N values


def _pick(value: Any, index: list[int]) -> Any:
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: _pick(v, index) for k, v in value.items()}
    if _is_row_tensors(value):
        return [_pick(v, index) for v in value]
    if _is_rows(value):
        return value[_index_like(value, index)]
    return [value[i] for i in index]


def _index_like(value: Any, index: list[int]) -> Any:
    if type(value).__module__.startswith("torch"):
        import torch

        return torch.tensor(index, dtype=torch.long, device=value.device)
    import numpy as np

    return np.asarray(index, dtype=np.int64)


def _join(values: list[Any], name: str) -> Any:
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError(f"mixing per sample: the sources' batches differ in {name!r}: some "
                         "have it, some not. Build the sources alike, or mix with "
                         "mixing='batch'")
    first = values[0]
    if isinstance(first, dict):
        if any(set(v) != set(first) for v in values):
            raise ValueError(f"mixing per sample: the sources' batches hold other {name!r} "
                             f"({[sorted(v) for v in values]}); build the sources alike")
        return {k: _join([v[k] for v in values], f"{name}.{k}") for k in first}
    if _is_row_tensors(first):
        return [_join(list(parts), f"{name}[{i}]") for i, parts in
                enumerate(zip(*values, strict=True))]
    if _is_rows(first):
        return _cat(values, name)
    return [item for v in values for item in v]


def _cat(values: list[Any], name: str) -> Any:
    shapes = {tuple(v.shape[1:]) for v in values}
    if len(shapes) > 1:
        raise ValueError(f"mixing per sample: the sources' {name!r} rows have other shapes "
                         f"{sorted(shapes)}, which one batch cannot hold; give the sources "
                         "the same size, or mix whole batches with mixing='batch'")
    if type(values[0]).__module__.startswith("torch"):
        import torch

        return torch.cat(values)
    import numpy as np

    return np.concatenate(values)
