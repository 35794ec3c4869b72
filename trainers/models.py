"""Models sized for the data: a small ResNet for the built-in images, a ResNet-50 built here
(the GPU check's workload, on a python with only torch), or a torchvision model by name when
torchvision is installed."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


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

    def __init__(self, num_classes: int, width: int = 16,
                 activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.activation_checkpointing = activation_checkpointing
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
        if not (self.activation_checkpointing and self.training):
            return self.head(self.features(x).mean((2, 3)))
        for layer in self.features:
            x = _checkpointed(layer, x) if isinstance(layer, _Block) else layer(x)
        return self.head(x.mean((2, 3)))


def _checkpointed(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Keep only the block's input; recompute its insides during backward, with BatchNorm
    statistics left alone the second time (the first forward updated them already)."""
    if torch.compiler.is_compiling():
        # Traced once by torch.compile: BatchNorm's statistics updates become part of the
        # forward graph, applied once, and backward recomputes only activations, so there is
        # nothing to freeze. (A context_fn there must give TorchDispatchModes, and a closure
        # is refused outright: "checkpoint not implemented for NestedUserFunctionVariable".)
        compiled: torch.Tensor = checkpoint(block, x, use_reentrant=False)
        return compiled
    out: torch.Tensor = checkpoint(block, x, use_reentrant=False,
                                   context_fn=functools.partial(_contexts, block))
    return out


def _contexts(block: nn.Module) -> tuple[Any, Any]:
    """The forward's context (none) and the recompute's (BatchNorm statistics frozen)."""
    return contextlib.nullcontext(), _frozen_statistics(block)


@contextlib.contextmanager
def _frozen_statistics(module: nn.Module) -> Iterator[None]:
    """BatchNorm with momentum 0 inside: running statistics do not move during recompute."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [(m, m.momentum, None if m.num_batches_tracked is None else
              m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, tracked in saved:
            m.momentum = momentum
            if tracked is not None and m.num_batches_tracked is not None:
                m.num_batches_tracked.copy_(tracked)


class _Bottleneck(nn.Module):
    """ResNet v1.5's block: 1x1 down, 3x3 (strided here), 1x1 up by four."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class ResNet50(nn.Module):
    """torchvision's resnet50 in shape (25,557,032 parameters at 1000 classes), built from
    torch alone: the GPU check runs its AMP step on a python that has no torchvision."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                   nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for i, (width, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)]):
            for b in range(blocks):
                layers.append(_Bottleneck(cin, width, 2 if b == 0 and i > 0 else 1))
                cin = width * 4
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def build_model(name: str, num_classes: int, activation_checkpointing: bool = False
                ) -> nn.Module:
    """`small-resnet` and `resnet50-local` (no dependency) or any torchvision classification
    model by name."""
    if name == "small-resnet":
        return SmallResNet(num_classes, activation_checkpointing=activation_checkpointing)
    if name == "resnet50-local" and not activation_checkpointing:
        return ResNet50(num_classes)
    if activation_checkpointing:
        raise ValueError(f"activation checkpointing is built into 'small-resnet'; for {name!r} "
                         "use torchvision's own memory options or drop the flag")
    try:
        import torchvision
    except ImportError:
        raise ImportError(f"model {name!r} needs torchvision (pip install torchvision); "
                          "'small-resnet' needs nothing") from None
    except Exception as exc:  # noqa: BLE001 - built for another torch: RuntimeError on import
        raise ImportError(f"model {name!r} needs torchvision, which is installed but does not "
                          f"import with this torch ({type(exc).__name__}: {exc}); install the "
                          "torchvision release made for this torch") from None
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def compile_model(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """torch.compile, kept optional: the first steps are slow while it compiles."""
    return torch.compile(model, backend=backend)  # type: ignore[return-value]
