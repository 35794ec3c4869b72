"""Several views of each sample: `image_loader(..., views=2)` or a list of op lists.

A view is a window of the image, resized, then ops. `views=V` gives V views of the loader's
own recipe (its crop, flip and `augment`) at `size`; a list gives one view per op list, whose
first op may be an ops.RandomResizedCrop or ops.CenterCrop (the view's window and size;
without one, the loader's own crop and flip at `size`), the rest ops run on the view as
`augment` runs (batchops.py). DINO's multi-crop:

    views=[[ops.RandomResizedCrop(224, scale=(0.4, 1)), ops.Flip()]] * 2
          + [[ops.RandomResizedCrop(96, scale=(0.05, 0.4)), ops.Flip()]] * 6

Each view draws apart: view v of sample `key` draws from the key `key#v` (view 0 from the
sample's own key, so a loader's first view is the image a loader without views gives). The
decoder reads every view's window of an image (V windows a sample, in one graph run) and the
batch carries `views`, one tensor per view, and `image`, the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class View:
    """One view: its window op (None: the loader's own crop and flip) and its ops."""

    size: int
    crop: Any  # shardflow.ops.WindowOp, or None
    ops: tuple[Any, ...]


def view_key(key: str, view: int) -> str:
    """The key view `view` of a sample draws from (its windows and its ops)."""
    return key if view == 0 else f"{key}#{view}"


def resolve(views: Any, size: int, augment: Sequence[Any], batch_augment: Sequence[Any]
            ) -> tuple[View, ...] | None:
    """The loader's views, or None without; ValueError for what cannot be views."""
    if views is None:
        return None
    if batch_augment:
        raise ValueError("views with batch_augment: mixup and cutmix of several views are "
                         "not defined here; leave batch_augment out, or mix each view "
                         "yourself (ops.Mix)")
    if isinstance(views, int) and not isinstance(views, bool):
        if views < 1:
            raise ValueError(f"views={views}: at least 1")
        _view(list(augment), size, 0)  # the same checks as a list's ops
        return tuple(View(size, None, tuple(augment)) for _ in range(views))
    if not isinstance(views, (list, tuple)) or not views or \
            not all(isinstance(v, (list, tuple)) for v in views):
        raise ValueError(f"views={views!r}: a number of views, or a list of op lists (one "
                         "per view)")
    if augment:
        raise ValueError("views as op lists with augment: put each view's ops in its list")
    return tuple(_view(list(ops_), size, i) for i, ops_ in enumerate(views))


def _view(ops_: list[Any], size: int, index: int) -> View:
    from shardflow import ops
    from shardflow.ops.crop import WindowOp

    crop = ops_.pop(0) if ops_ and isinstance(ops_[0], WindowOp) else None
    for op in ops_:
        if isinstance(op, WindowOp):
            raise ValueError(f"views[{index}]: {op!r} is a window op; it can only come first "
                             "in a view (the view's crop)")
        if not isinstance(op, ops.Op):
            raise ValueError(f"views[{index}]: {op!r} is not a shardflow.ops.Op")
    return View(crop.size if crop is not None else size, crop, tuple(ops_))
