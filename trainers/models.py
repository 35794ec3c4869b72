"""Models sized for the data: a small ResNet for the built-in images, or a torchvision model
by name when torchvision is installed."""

from __future__ import annotations

import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout))
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class SmallResNet(nn.Module):
    """Four residual stages (widths w, 2w, 4w, 8w), global pooling, a linear head."""

    def __init__(self, num_classes: int, width: int = 16) -> None:
        super().__init__()
        widths = [width, width * 2, width * 4, width * 8]
        layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                   nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        cin = width
        for i, w in enumerate(widths):
            layers.append(_Block(cin, w, 1 if i == 0 else 2))
            cin = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def build_model(name: str, num_classes: int) -> nn.Module:
    """`small-resnet` (no dependency) or any torchvision classification model by name."""
    if name == "small-resnet":
        return SmallResNet(num_classes)
    try:
        import torchvision
    except ImportError:
        raise ImportError(f"model {name!r} needs torchvision (pip install torchvision); "
                          "'small-resnet' needs nothing") from None
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
