"""The `Task` protocol: a task owns its model and turns a batch into a loss and metrics.

The training loop knows nothing about images, text or point clouds; it calls these methods.
A user plugs in their own task (and model) by implementing the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


@dataclass
class StepOutput:
    """What one forward pass gives the loop: the loss to minimise and numbers to log."""

    loss: torch.Tensor
    logs: dict[str, float] = field(default_factory=dict)


@dataclass
class EvalTotals:
    """Sums over an evaluation pass; `metrics()` turns them into averages."""

    loss_sum: float = 0.0
    correct: int = 0
    count: int = 0

    def add(self, other: EvalTotals) -> None:
        self.loss_sum += other.loss_sum
        self.correct += other.correct
        self.count += other.count

    def metrics(self) -> dict[str, float]:
        if not self.count:
            return {"eval_loss": float("nan"), "accuracy": float("nan")}
        return {"eval_loss": self.loss_sum / self.count, "accuracy": self.correct / self.count}

    def over_ranks(self, dist: Any) -> dict[str, float]:
        """The metrics of every rank's totals together (collective under DDP). Totals that
        are not sums (AUC ranks every held-out row: trainers/ctr_metrics.py) override this."""
        from shardflow.trainers.distributed import sum_over_ranks

        summed = sum_over_ranks([self.loss_sum, self.correct, self.count], dist)
        return EvalTotals(summed[0], int(summed[1]), int(summed[2])).metrics()


class Task(Protocol):
    """A model and what to do with a batch. `describe()` identifies it in checkpoints."""

    model: nn.Module

    def forward(self, batch: Any) -> StepOutput:
        """Loss (and logs) of one batch, under the loop's autocast."""

    def evaluate(self, batch: Any) -> EvalTotals:
        """Sums for one held-out batch (no gradients; the loop disables them). A task whose
        totals are a subclass of EvalTotals also has `new_totals()`, the empty ones the loop
        adds each batch's into."""

    def describe(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this task (model, classes...)."""
