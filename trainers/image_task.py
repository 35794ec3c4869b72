"""Image classification: uint8 batches normalized on the device, cross-entropy, accuracy."""

from __future__ import annotations

from typing import Any

import torch

from trainers.classify import Classification
from trainers.models import build_model

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


class ImageClassification(Classification):
    """A classifier over `ImageBatch(image, label, keys)`; images arrive uint8 NCHW."""

    def __init__(self, num_classes: int, model: str = "small-resnet",
                 device: torch.device | str = "cpu", activation_checkpointing: bool = False
                 ) -> None:
        self.num_classes, self.model_name = num_classes, model
        self.device = torch.device(device)
        self.model = build_model(model, num_classes, activation_checkpointing).to(self.device)
        self.mean = torch.tensor(MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=self.device).view(1, 3, 1, 1)

    def _inputs(self, batch: Any) -> torch.Tensor:
        if batch.label is None:  # called before any use of the labels, in training and eval
            raise ValueError("image classification needs labels, but this batch has none: "
                             "its loader was built with labels=False (image-only or caption "
                             "shards); build it with labels=True from shards with .cls labels")
        image = batch.image
        if image.dtype == torch.uint8:  # the loader sends uint8 (4x fewer bytes): normalize here
            image = (image.float() - self.mean) / self.std
        return image

    def describe(self) -> dict[str, Any]:
        return {"task": "image", "model": self.model_name, "num_classes": self.num_classes}
