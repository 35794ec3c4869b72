"""Batch ops: MixUp and CutMix with soft targets, timm's Mixup in batch mode.

Each batch mixes with itself flipped (image i with image N-1-i): mixup blends the two by
lambda ~ Beta(alpha, alpha); cutmix pastes a box of the flipped batch whose side is
sqrt(1 - lambda) of the image's, clipped at the borders, and lambda becomes the share of the
image left unpasted. The targets mix by the same lambda, from one-hot rows smoothed by
`label_smoothing` (each row sums to 1). The draws come from the batch's generator, seeded by
(seed, epoch, the batch's keys): the same batch mixes the same way on any rank, after a
resume.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardflow.ops.base import to_uint8


def batch_rng(seed: int, epoch: int, keys: Sequence[str]) -> random.Random:
    """The generator of one batch, from its keys (a digest: batches are long)."""
    digest = hashlib.sha256("\0".join(keys).encode()).hexdigest()
    return random.Random(f"batch/{seed}/{epoch}/{digest}")


def soft_targets(labels: torch.Tensor, classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """One-hot rows (N, classes), float32, smoothed as timm does: `smoothing / classes`
    everywhere, `1 - smoothing` more on the label."""
    off = smoothing / classes
    out = torch.full((len(labels), classes), off, dtype=torch.float32, device=labels.device)
    return out.scatter_(1, labels.long().view(-1, 1), 1.0 - smoothing + off)


@dataclass(frozen=True)
class MixParams:
    """What one batch gets: lambda, and the pasted box for cutmix (rows y0:y1, cols x0:x1)."""

    lam: float
    box: tuple[int, int, int, int] | None = None  # y0, y1, x0, x1


class Mix:
    """timm's Mixup (mode 'batch'): with probability `prob` a batch is mixed; with both
    alphas above 0, cutmix is chosen with probability `switch_prob`, else mixup."""

    def __init__(self, mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0, *,
                 classes: int | None = None, prob: float = 1.0, switch_prob: float = 0.5,
                 label_smoothing: float = 0.1) -> None:
        """`classes`: the soft targets' width; None: a loader's batch_augment takes it from
        the shards' manifest (ops.apply outside a loader needs it given)."""
        if mixup_alpha <= 0 and cutmix_alpha <= 0:
            raise ValueError("Mix needs mixup_alpha > 0 or cutmix_alpha > 0")
        if classes is not None and classes < 1:
            raise ValueError(f"Mix classes={classes}: must be at least 1")
        self.mixup_alpha, self.cutmix_alpha, self.classes = mixup_alpha, cutmix_alpha, classes
        self.prob, self.switch_prob, self.label_smoothing = prob, switch_prob, label_smoothing

    def __repr__(self) -> str:
        return (f"Mix(mixup_alpha={self.mixup_alpha}, cutmix_alpha={self.cutmix_alpha}, "
                f"classes={self.classes}, prob={self.prob}, switch_prob={self.switch_prob}, "
                f"label_smoothing={self.label_smoothing})")

    def draw(self, rng: random.Random, height: int, width: int) -> MixParams:
        if rng.random() >= self.prob:
            return MixParams(1.0)
        cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0
                                            or rng.random() < self.switch_prob)
        if not cutmix:
            return MixParams(rng.betavariate(self.mixup_alpha, self.mixup_alpha))
        lam = rng.betavariate(self.cutmix_alpha, self.cutmix_alpha)
        side = math.sqrt(1.0 - lam)
        cut_h, cut_w = int(height * side), int(width * side)
        cy, cx = rng.randrange(height), rng.randrange(width)
        y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height)
        x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, width)
        # lambda corrected for the clipping: the share of the image that is not pasted
        return MixParams(1.0 - (y1 - y0) * (x1 - x0) / (height * width), (y0, y1, x0, x1))

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, rng: random.Random
                 ) -> tuple[torch.Tensor, torch.Tensor, MixParams]:
        """(images, soft targets (N, classes), what was drawn). uint8 images stay uint8
        (mixup rounds to the nearest level); float images are mixed in float."""
        if self.classes is None:
            raise ValueError(f"{self!r}: give classes=N (a loader's batch_augment takes it "
                             "from the shards' manifest)")
        params = self.draw(rng, images.shape[-2], images.shape[-1])
        targets = soft_targets(labels, self.classes, self.label_smoothing)
        targets = params.lam * targets + (1.0 - params.lam) * targets.flip(0)
        if params.box is not None:
            y0, y1, x0, x1 = params.box
            out, n = images.clone(), len(images)
            if images.device.type == "cpu":  # each box from its view: no flipped batch
                for i in range(n):
                    out[i, :, y0:y1, x0:x1] = images[n - 1 - i, :, y0:y1, x0:x1]
            else:
                out[..., y0:y1, x0:x1] = images.flip(0)[..., y0:y1, x0:x1]
            images = out
        elif params.lam != 1.0:
            images = _blend(images, params.lam)
        return images, targets, params


def _blend(images: torch.Tensor, lam: float) -> torch.Tensor:
    """lam * image i + (1 - lam) * image N-1-i, uint8 rounded to the nearest level. On the
    CPU image by image, the float temporaries in the cache: 0.17 ms an image of 224 against
    1.56 for the whole batch at once (measured at 64), the same values. (A table of the
    256 x 256 pairs of levels, taken image by image, measured no faster: 0.185.)"""
    def mixed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = a.to(torch.float32, copy=True).mul_(lam)  # never in place on the input
        out.add_(b.to(torch.float32, copy=True).mul_(1.0 - lam))
        if images.is_floating_point():
            return out.to(images.dtype)
        out.round_()
        return to_uint8(out) if images.dtype == torch.uint8 else out.to(images.dtype)

    if images.device.type != "cpu":
        return mixed(images, images.flip(0))
    out, n = torch.empty_like(images), len(images)
    for i in range(n):
        out[i] = mixed(images[i], images[n - 1 - i])
    return out


def MixUp(alpha: float = 0.8, **options: float) -> Mix:  # noqa: N802 - reads as an op
    """Mixup alone: Mix(mixup_alpha=alpha, cutmix_alpha=0)."""
    return Mix(alpha, 0.0, **options)  # type: ignore[arg-type]


def CutMix(alpha: float = 1.0, **options: float) -> Mix:  # noqa: N802 - reads as an op
    """CutMix alone: Mix(mixup_alpha=0, cutmix_alpha=alpha)."""
    return Mix(0.0, alpha, **options)  # type: ignore[arg-type]
