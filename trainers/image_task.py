"""Image classification: uint8 batches normalized on the device, cross-entropy, accuracy.

With `augment` (train.py's --augment, --mixup, --cutmix, --label-smoothing), each training
batch goes through pipeline.ops on the device it arrived on, before normalization: the ops'
draws come from (seed, the loader's epoch, each key), so a resumed run trains on the same
pixels; mixed batches train on their soft targets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from trainers.classify import Classification
from trainers.models import build_model
from trainers.task import StepOutput

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


@dataclass
class TrainAugment:
    """Ops on each training batch, then mixup/cutmix or label smoothing alone."""

    ops: Sequence[Any]  # pipeline.ops.Op
    mix: Any  # pipeline.ops.Mix, or None
    label_smoothing: float
    seed: int
    epoch_of: Callable[[], int]  # the training loader's epoch, read as each batch trains

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(augmented uint8 images, soft targets, or None where there is no mixing)."""
        from pipeline import ops

        epoch = self.epoch_of()
        images = ops.apply(self.ops, batch.image, ops.sample_rngs(self.seed, epoch, batch.keys))
        if self.mix is None:
            return images, None
        images, targets, _ = self.mix(images, batch.label,
                                      ops.batch_rng(self.seed, epoch, batch.keys))
        return images, targets


class ImageClassification(Classification):
    """A classifier over `ImageBatch(image, label, keys)`; images arrive uint8 NCHW."""

    def __init__(self, num_classes: int, model: str = "small-resnet",
                 device: torch.device | str = "cpu", activation_checkpointing: bool = False,
                 augment: TrainAugment | None = None) -> None:
        self.num_classes, self.model_name, self.augment = num_classes, model, augment
        self.device = torch.device(device)
        self.model = build_model(model, num_classes, activation_checkpointing).to(self.device)
        self.mean = torch.tensor(MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=self.device).view(1, 3, 1, 1)

    def _inputs(self, batch: Any) -> torch.Tensor:
        if batch.label is None:  # called before any use of the labels, in training and eval
            raise ValueError("image classification needs labels, but this batch has none: "
                             "its loader was built with labels=False (image-only or caption "
                             "shards); build it with labels=True from shards with .cls labels")
        return self._normalize(batch.image)

    def _normalize(self, image: torch.Tensor) -> torch.Tensor:
        if image.dtype == torch.uint8:  # the loader sends uint8 (4x fewer bytes): normalize here
            image = (image.float() - self.mean) / self.std
        return image

    def forward(self, batch: Any) -> StepOutput:
        if self.augment is None:
            return super().forward(batch)
        self._inputs(batch)  # the label check
        images, targets = self.augment(batch)
        logits = self.model(self._normalize(images)).float()
        if targets is None:
            return StepOutput(F.cross_entropy(logits, batch.label,
                                              label_smoothing=self.augment.label_smoothing))
        return StepOutput(torch.sum(-targets * F.log_softmax(logits, dim=1), dim=1).mean())

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task": "image", "model": self.model_name,
                               "num_classes": self.num_classes}
        if self.augment is not None:
            out["augment"] = {"ops": [repr(op) for op in self.augment.ops],
                              "mix": repr(self.augment.mix) if self.augment.mix else None,
                              "label_smoothing": self.augment.label_smoothing}
        return out
