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

    @abstractmethod
    def _inputs(self, batch: Any) -> torch.Tensor:
        """The model's input from a batch (on the batch's device)."""

    def forward(self, batch: Any) -> StepOutput:
        logits = self.model(self._inputs(batch))
        return StepOutput(F.cross_entropy(logits.float(), batch.label))

    def evaluate(self, batch: Any) -> EvalTotals:
        logits = self.model(self._inputs(batch)).float()
        loss = F.cross_entropy(logits, batch.label, reduction="sum")
        correct = (logits.argmax(1) == batch.label).sum()
        # .item() syncs with the device; evaluation is not the hot path
        return EvalTotals(float(loss.item()), int(correct.item()), len(batch.label))
