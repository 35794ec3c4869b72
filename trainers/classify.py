"""What every classification task shares (images, point clouds): cross-entropy on the
model's logits, and evaluation sums (loss, correct, count). A subclass says how a batch
becomes the model's input (`_inputs`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F

from shardflow.trainers.task import EvalTotals, StepOutput


class Classification(ABC):
    model: torch.nn.Module

    def class_counts(self, which: str) -> torch.Tensor | None:
        """How often each class was met, in training ("train") or evaluation ("eval"), kept
        on the model's device: counted without a sync per step. None for a task that does not
        say its class count (`num_classes`)."""
        classes = getattr(self, "num_classes", None)
        if classes is None:
            return None
        name = f"_{which}_counts"
        if getattr(self, name, None) is None:
            device = next(self.model.parameters()).device
            setattr(self, name, torch.zeros(classes, dtype=torch.int64, device=device))
        return getattr(self, name)  # type: ignore[no-any-return]

    def _count(self, label: torch.Tensor, which: str) -> None:
        counts = self.class_counts(which)
        if counts is not None:
            counts.index_add_(0, label.clamp(0, len(counts) - 1).long(),
                              torch.ones_like(label, dtype=torch.int64))

    @abstractmethod
    def _inputs(self, batch: Any) -> torch.Tensor:
        """The model's input from a batch (on the batch's device)."""

    def forward(self, batch: Any) -> StepOutput:
        logits = self.model(self._inputs(batch))
        self._count(batch.label, "train")
        return StepOutput(F.cross_entropy(logits.float(), batch.label))

    def evaluate(self, batch: Any) -> EvalTotals:
        logits = self.model(self._inputs(batch)).float()
        self._count(batch.label, "eval")
        loss = F.cross_entropy(logits, batch.label, reduction="sum")
        correct = (logits.argmax(1) == batch.label).sum()
        # .item() syncs with the device; evaluation is not the hot path
        return EvalTotals(float(loss.item()), int(correct.item()), len(batch.label))
