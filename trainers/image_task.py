"""Image classification: uint8 batches normalized on the device, cross-entropy, accuracy.

A batch from a loader built with batch_augment (train.py's --mixup, --cutmix) carries soft
targets (`batch.target`, rows summing to 1): the loss is then the cross-entropy against
them. Otherwise the labels' cross-entropy, smoothed by `label_smoothing`. The ops of
--augment run in the training loader itself (trainers/wiring.py), not here."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from shardflow.trainers.classify import Classification
from shardflow.trainers.models import build_model
from shardflow.trainers.task import StepOutput

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


class ImageClassification(Classification):
    """A classifier over `ImageBatch(image, label, keys)`; images arrive uint8 NCHW."""

    def __init__(self, num_classes: int, model: str = "small-resnet",
                 device: torch.device | str = "cpu", activation_checkpointing: bool = False,
                 label_smoothing: float = 0.0, recipe: dict[str, Any] | None = None) -> None:
        """`recipe`: what the training loader's ops are and where they run, for describe()
        (summary.json's setup); the loader runs them."""
        self.num_classes, self.model_name = num_classes, model
        self.label_smoothing, self.recipe = label_smoothing, recipe
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
        logits = self.model(self._inputs(batch)).float()
        self._count(batch.label, "train")
        target = getattr(batch, "target", None)
        if target is not None:  # mixed: soft targets, smoothed by the mix
            return StepOutput(torch.sum(-target * F.log_softmax(logits, dim=1),
                                        dim=1).mean())
        return StepOutput(F.cross_entropy(logits, batch.label,
                                          label_smoothing=self.label_smoothing))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task": "image", "model": self.model_name,
                               "num_classes": self.num_classes}
        if self.recipe is not None:
            out["augment"] = self.recipe
        return out
