"""Segmentation metrics over a held-out set: point accuracy, per-class IoU and their mean.

    evaluate(batch) -> SegTotals(loss, correct, labelled, per-class intersection and union)
       .add(...) per batch -> over_ranks(dist): the counts summed over ranks -> metrics()
    metrics: eval_loss, accuracy, miou, iou_<class> (every class but the ignored one),
             labelled_points, unpredicted_points

The rules, each stated once here:

- Points labelled `ignore_label` count nowhere: not in the accuracy, not in any class's
  intersection or union (SemanticKITTI's evaluator drops them alike).
- A labelled point without a prediction (the bev model's points outside the voxel grid) is
  a wrong answer: in its class's union, never in an intersection, not correct; so both models
  are scored on the same points. `unpredicted_points` counts them.
- IoU of class c = intersection / union over the whole held-out set (not a mean over
  batches). `miou` is the mean over the classes other than the ignored one whose union is
  not 0: those that occur in the labels or the predictions. A class absent from both is left
  out (its `iou_<class>` is NaN), where SemanticKITTI's evaluator scores it 0 and averages
  over all classes but the ignored one; the two agree when every class occurs (its
  validation sequence has them all).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from shardflow.trainers.task import EvalTotals


@dataclass
class SegTotals(EvalTotals):
    """Sums of an evaluation of per-point classes. `count`: labelled points, `correct`: those
    predicted right; `loss_sum` over `loss_points` (the points with a prediction); lists of
    `num_classes` counts, on the host."""

    loss_points: int = 0
    unpredicted: int = 0
    intersection: list[int] = field(default_factory=list)
    union: list[int] = field(default_factory=list)
    ignore_label: int = 0
    class_names: list[str] | None = None

    def add(self, other: EvalTotals) -> None:
        super().add(other)
        if isinstance(other, SegTotals):
            self.loss_points += other.loss_points
            self.unpredicted += other.unpredicted
            self.intersection = _plus(self.intersection, other.intersection)
            self.union = _plus(self.union, other.union)

    def metrics(self) -> dict[str, float]:
        nan = float("nan")
        ious = {c: i / u if u else nan
                for c, (i, u) in enumerate(zip(self.intersection, self.union, strict=True))
                if c != self.ignore_label}
        present = [v for v in ious.values() if not math.isnan(v)]
        names = metric_names(len(self.union), self.class_names)
        return {"eval_loss": self.loss_sum / self.loss_points if self.loss_points else nan,
                "accuracy": self.correct / self.count if self.count else nan,
                "miou": sum(present) / len(present) if present else nan,
                **{f"iou_{names[c]}": v for c, v in ious.items()},
                "labelled_points": float(self.count),
                "unpredicted_points": float(self.unpredicted)}

    def over_ranks(self, dist: Any) -> dict[str, float]:
        """The metrics of every rank's counts summed (one all-reduce: every rank's totals
        have one entry per class, from the task's `new_totals()`)."""
        from shardflow.trainers.distributed import sum_over_ranks

        k = len(self.union)
        sums = sum_over_ranks([self.loss_sum, self.correct, self.count, self.loss_points,
                               self.unpredicted, *self.intersection, *self.union], dist)
        whole = [int(v) for v in sums[1:]]  # float64 sums of counts: exact below 2**53
        return replace(self, loss_sum=sums[0], correct=whole[0], count=whole[1],
                       loss_points=whole[2], unpredicted=whole[3],
                       intersection=whole[4:4 + k], union=whole[4 + k:]).metrics()


def _plus(a: list[int], b: list[int]) -> list[int]:
    if not a:
        return list(b)
    if b and len(a) != len(b):
        raise ValueError(f"adding totals of {len(b)} classes to totals of {len(a)}")
    return [x + y for x, y in zip(a, b, strict=False)]


def metric_names(num_classes: int, class_names: list[str] | None) -> list[str]:
    """The name of each class in metric keys (`iou_<name>`): its class name lower-cased,
    runs of other characters than letters and digits as "_" ("traffic-sign" ->
    "traffic_sign"), else its index."""
    if not class_names:
        return [str(c) for c in range(num_classes)]
    names = [re.sub(r"[^0-9a-z]+", "_", n.lower()).strip("_") for n in class_names]
    return [name or str(c) for c, name in enumerate(names)]


def point_totals(logits: torch.Tensor, labels: torch.Tensor, predicted: torch.Tensor | None,
                 ignore_label: int, class_names: list[str] | None = None) -> SegTotals:
    """The counts of one batch (loss_sum left 0: the task adds it). `logits` (P, K) float;
    `predicted` (P,) bool: the points that have a prediction (None: all). The ignored
    class is never predicted: its logit is masked, as it was never a target."""
    k = logits.shape[1]
    if 0 <= ignore_label < k:
        logits = logits.clone()
        logits[:, ignore_label] = float("-inf")
    pred = logits.argmax(dim=1)
    if predicted is not None:
        pred = pred.masked_fill(~predicted, -1)
    labelled = labels != ignore_label
    pred, label = pred[labelled], labels[labelled]  # boolean masks sync: not the hot path
    hit = pred == label
    intersection = torch.bincount(label[hit], minlength=k)
    union = torch.bincount(label, minlength=k) + torch.bincount(pred[pred >= 0], minlength=k) \
        - intersection
    return SegTotals(correct=int(hit.sum()), count=len(label), unpredicted=int((pred < 0).sum()),
                     intersection=intersection.tolist(), union=union.tolist(),
                     ignore_label=ignore_label, class_names=class_names)
