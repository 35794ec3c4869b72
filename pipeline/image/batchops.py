"""The user's ops on each decoded batch: `image_loader(augment=[...], batch_augment=[...])`.

After the loader's own crop, resize and flip, `augment` (shardflow.ops ops) runs over the
batch's uint8 images, each sample's parameters drawn from its generator (seed, epoch, key:
ops.sample_rngs), then `batch_augment` (one ops.Mix: mixup or cutmix) from the batch's
generator (ops.batch_rng), giving `batch.target`, soft targets (N, classes). The draws are
the ones `ops.apply` makes on the loader's plain batches, so a batch comes out the same on
either backend and reader, on any rank count, after a resume.

Where they run: for a CPU loader, in two helper threads beside the decode stage's
(decode.OPS_WORKERS: a batch each, while that thread resizes the next), so they overlap the
consumer's step; for a GPU loader, on the device once the batch is delivered, on the
consumer's stream (loader.py's `_delivered`). Normalization, if asked for, comes after them:
the ops take uint8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardflow.image.views import View, view_key
from shardflow.loading.batch import ImageBatch
from shardflow.loading.readers import Placement


@dataclass(frozen=True)
class BatchOps:
    """The ops of one loader, with what they need to draw and to lay out."""

    ops: tuple[Any, ...]  # shardflow.ops.Op
    mix: Any  # shardflow.ops.Mix, or None
    seed: int
    channels_first: bool
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None  # 0..255 units, or None
    views: tuple[View, ...] | None = None  # each view's ops (then `ops` is empty)
    targets: tuple[str, ...] = ()  # the names of batch.targets, warped with the images

    def __call__(self, batch: ImageBatch, epoch: int, done: int = 0) -> ImageBatch:
        """The batch with its images (each view's) augmented and normalized, and, with a
        mix, its soft targets: a new ImageBatch, the keys, labels and extras unchanged.
        `done`: the leading ops the DALI graph already ran (drawn again, not run)."""
        from shardflow import ops

        if self.views is not None and batch.views is not None:
            views = [self._one(image, view.ops, epoch, [view_key(k, v) for k in batch.keys])
                     for v, (image, view) in enumerate(zip(batch.views, self.views,
                                                           strict=True))]
            return ImageBatch(image=views[0], label=batch.label, keys=batch.keys,
                              extras=batch.extras, views=views)
        if self.targets and batch.targets is not None:
            image, maps = self._with_targets(batch, epoch)
            return ImageBatch(image=image, label=batch.label, keys=batch.keys,
                              extras=batch.extras, targets=maps)
        if self.mix is None:
            return ImageBatch(image=self._one(batch.image, self.ops, epoch, batch.keys, done),
                              label=batch.label, keys=batch.keys, extras=batch.extras)
        images = self._nchw(batch.image)
        if len(images):  # an empty batch (every sample skipped) has nothing to draw for
            images = ops.apply(self.ops, images, ops.sample_rngs(self.seed, epoch, batch.keys),
                               done=done)
        images, target, _ = self.mix(images, batch.label,
                                     ops.batch_rng(self.seed, epoch, batch.keys))
        return ImageBatch(image=self._finished(images), label=batch.label, keys=batch.keys,
                          extras=batch.extras, target=target)

    def _with_targets(self, batch: ImageBatch, epoch: int) -> tuple[Any, dict[str, Any]]:
        """The images through the ops, and each target's masks through their geometry
        (ops.apply's masks: the same draws; colour ops leave masks as they are)."""
        import torch

        from shardflow import ops

        assert batch.targets is not None
        images = self._nchw(batch.image)
        maps = {name: batch.targets[name] for name in self.targets}
        if not len(images) or not self.ops:
            return self._finished(images), maps
        # Labels and continuous values (float: bilinear) each as channels of one (N, K, H, W)
        # tensor, through the same draws (each apply draws afresh from the same keys).
        labels = [n for n, m in maps.items() if not m.is_floating_point()]
        values = [n for n, m in maps.items() if m.is_floating_point()]
        warped = images
        for names in (labels, values):
            if not names:
                continue
            common = torch.float32 if names is values else torch.int32 if any(
                maps[n].dtype != torch.uint8 for n in names) else torch.uint8
            stacked = torch.stack([maps[n].to(common) for n in names], dim=1)
            # an op may work in place: the first of two applies gets a copy of the images
            first = names is labels and bool(values)
            warped, stacked = ops.apply(self.ops, images.clone() if first else images,
                                        ops.sample_rngs(self.seed, epoch, batch.keys),
                                        masks=stacked)
            maps.update({n: m.to(maps[n].dtype)
                         for n, m in zip(names, stacked.unbind(1), strict=True)})
        return self._finished(warped), maps

    def _one(self, image: Any, ops_: Sequence[Any], epoch: int, keys: list[str],
             done: int = 0) -> Any:
        """One view's (or the batch's) images through `ops_` (but the first `done`), each
        drawn from its key."""
        from shardflow import ops

        images = self._nchw(image)
        if len(images) and len(ops_) > done:
            images = ops.apply(ops_, images, ops.sample_rngs(self.seed, epoch, keys),
                               done=done)
        return self._finished(images)

    def _nchw(self, image: Any) -> Any:
        return image if self.channels_first else image.permute(0, 3, 1, 2)

    def _finished(self, images: Any) -> Any:
        """uint8 NCHW as the loader's layout and dtype: normalized, NHWC if asked."""
        if self.normalize is not None:
            images = _normalized(images, *self.normalize)
        if not self.channels_first:
            images = images.permute(0, 2, 3, 1)
        return images.contiguous()

    def describe(self, device: str, in_graph: str | None = None, done: int = 0
                 ) -> list[dict[str, str]]:
        """Where each op runs: one entry per op, in order (with views, per view); the first
        `done` in the graph `in_graph` names."""
        where = ("torch on the CPU, in the decode stage's helper threads" if device == "cpu"
                 else f"torch on {device}, after delivery, on the consumer's stream")
        if self.views is not None:
            return [{"op": repr(op), "runs": where, "view": str(v)}
                    for v, view in enumerate(self.views) for op in view.ops]
        entries = [{"op": repr(op), "runs": in_graph if j < done and in_graph else where}
                   for j, op in enumerate(self.ops)]
        if self.mix is not None:
            entries.append({"op": repr(self.mix), "runs": where})
        return entries


def after_delivery(placement: Placement) -> bool:
    """Whether a loader placed so runs its ops on the consumer's side once a batch is
    delivered (a GPU loader), not in the decode stage (a CPU loader): one decision, that the
    stage (decode.py) and the loader (loader.py's `_delivered`) both read here."""
    return placement.target != "cpu"


def build(augment: Sequence[Any], batch_augment: Sequence[Any], *, seed: int,
          channels_first: bool, normalize: tuple[Any, Any] | None, labels: bool,
          num_classes: int | None, views: tuple[View, ...] | None = None,
          targets: Sequence[tuple[str, str]] = ()) -> BatchOps | None:
    """The loader's BatchOps, or None when it has no ops, views or targets (those are laid
    out and normalized here, after their ops); ValueError for ops it cannot run."""
    from shardflow import ops

    mean_std = (tuple(normalize[0]), tuple(normalize[1])) if normalize else None
    if views is not None:  # views.resolve checked their ops
        return BatchOps((), None, seed, channels_first, mean_std, views)
    if not augment and not batch_augment and not targets:
        return None
    for op in augment:
        if not isinstance(op, ops.Op):
            raise ValueError(f"augment: {op!r} is not a shardflow.ops.Op (subclass ops.Op with "
                             "draw and torch; mixup and cutmix go in batch_augment)")
        if isinstance(op, ops.crop.WindowOp):  # torchvision's habit: a crop would crop twice
            raise ValueError(f"augment: {op!r} chooses a window, and the loader crops already "
                             "(size, crop_scale, crop_ratio; train=False: crop_fraction): set "
                             "those, or give views=[View(...)] for crops of their own")
    if len(batch_augment) > 1:
        raise ValueError(f"batch_augment={list(batch_augment)!r}: one ops.Mix at most (it "
                         "mixes mixup and cutmix itself: ops.Mix(mixup_alpha, cutmix_alpha))")
    mix = batch_augment[0] if batch_augment else None
    if mix is not None:
        mix = _checked_mix(mix, labels, num_classes)
    return BatchOps(tuple(augment), mix, seed, channels_first, mean_std,
                    targets=tuple(name for name, _ in targets))


def _checked_mix(mix: Any, labels: bool, num_classes: int | None) -> Any:
    """The mix as the loader runs it: checked against the shards' classes, and given their
    count where it was left out (ops.MixUp(0.8), as timm's users write it)."""
    import copy

    from shardflow import ops

    if not isinstance(mix, ops.Mix):
        raise ValueError(f"batch_augment: {mix!r} is not an ops.Mix (ops.MixUp, ops.CutMix "
                         "or ops.Mix)")
    if not labels:
        raise ValueError("batch_augment mixes labels into soft targets, but this loader reads "
                         "none (labels=False)")
    if mix.classes is None:
        if num_classes is None:
            raise ValueError(f"batch_augment: {mix!r} has no class count and the shards' "
                             "manifest gives none: pass classes=N")
        mix = copy.copy(mix)  # the user's op stays as given
        mix.classes = num_classes
    if num_classes is not None and mix.classes != num_classes:
        raise ValueError(f"batch_augment: {mix!r} has classes={mix.classes}, but the shards "
                         f"hold {num_classes} classes")
    return mix


def _normalized(images: Any, mean: Sequence[float], std: Sequence[float]) -> Any:
    """float32 (x - mean) / std in 0..255 units, as the copier and resize.py normalize."""
    import torch

    from shardflow.ops.base import on_device  # through pinned memory: no host sync

    m = on_device(list(mean), images.device, torch.float32).view(1, -1, 1, 1)
    s = on_device(list(std), images.device, torch.float32).view(1, -1, 1, 1)
    return (images.float() - m) / s
