"""RandAugment and TrivialAugmentWide: torchvision's op spaces and draws, per image.

Each image draws its own ops (a name, a magnitude bin, a sign) from its generator; the torch
form runs the batch one step at a time, each op once over the images that drew it, so a
batch costs at most (steps x 14) batched calls, never a call per image.

    RandAugment(num_ops=2, magnitude=9): num_ops ops, uniformly, at bin `magnitude` of 31
    TrivialAugmentWide(): one op, uniformly, at a bin drawn uniformly
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor  # in the classes below, `torch` is also the method of each op

from pipeline.ops import color, geometry
from pipeline.ops.base import Op, check_uint8, on_device

# name -> (magnitude of bin i of n for an image of h x w, signed); None: no magnitude
Space = dict[str, tuple[Callable[[float, int, int, int], float] | None, bool]]


def _linear(top: float) -> Callable[[float, int, int, int], float]:
    return lambda i, n, h, w: top * i / (n - 1)


def _space(shear: float, translate: Callable[[float, int, int, int], tuple[float, float]],
           rotate: float, enhance: float, posterize_span: int) -> Space:
    return {
        "Identity": (None, False),
        "ShearX": (_linear(shear), True), "ShearY": (_linear(shear), True),
        "TranslateX": (lambda i, n, h, w: translate(i, n, h, w)[0], True),
        "TranslateY": (lambda i, n, h, w: translate(i, n, h, w)[1], True),
        "Rotate": (_linear(rotate), True),
        "Brightness": (_linear(enhance), True), "Color": (_linear(enhance), True),
        "Contrast": (_linear(enhance), True), "Sharpness": (_linear(enhance), True),
        # torchvision: 8 - round(i / ((n - 1) / span)) bits
        "Posterize": (lambda i, n, h, w: float(8 - round(i / ((n - 1) / posterize_span))),
                      False),
        "Solarize": (lambda i, n, h, w: 255.0 * (1 - i / (n - 1)), False),
        "AutoContrast": (None, False), "Equalize": (None, False),
    }


RAND_AUGMENT = _space(0.3, lambda i, n, h, w: (150 / 331 * w * i / (n - 1),
                                               150 / 331 * h * i / (n - 1)), 30.0, 0.9, 4)
TRIVIAL_AUGMENT_WIDE = _space(0.99, lambda i, n, h, w: (32.0 * i / (n - 1),
                                                        32.0 * i / (n - 1)), 135.0, 0.99, 6)


def _affine(images: Tensor, matrices: list[list[float]]) -> Tensor:
    return geometry.warp(images, matrices)


def run_op(name: str, images: Tensor, mags: list[float]) -> Tensor:
    """torchvision's _apply_op for `name`, one magnitude per image, batched."""
    n, _, h, w = images.shape
    corner = (-w / 2, -h / 2)  # the shears are about the top-left corner, as torchvision's

    def factors(offset: float = 1.0) -> Tensor:
        return on_device([offset + m for m in mags], images.device).view(-1, 1, 1, 1)

    if name == "Identity":
        return images
    if name in ("ShearX", "ShearY"):
        shears = [(math.degrees(math.atan(m)), 0.0) if name == "ShearX"
                  else (0.0, math.degrees(math.atan(m))) for m in mags]
        return _affine(images, [geometry.inverse_affine(0.0, (0.0, 0.0), 1.0, s, corner)
                                for s in shears])
    if name in ("TranslateX", "TranslateY"):
        moves = [(int(m), 0) if name == "TranslateX" else (0, int(m)) for m in mags]
        if images.device.type == "cpu":  # whole pixels: a copy, as the warp would give
            return geometry.shift(images, moves)
        return _affine(images, [geometry.inverse_affine(0.0, (float(x), float(y)), 1.0,
                                                        (0.0, 0.0)) for x, y in moves])
    if name == "Rotate":  # counter-clockwise, as F.rotate
        return _affine(images, [geometry.inverse_affine(-m, (0.0, 0.0), 1.0, (0.0, 0.0))
                                for m in mags])
    enhance = {"Brightness": color.brightness, "Color": color.saturation,
               "Contrast": color.contrast, "Sharpness": geometry.sharpness}
    if name in enhance:
        return enhance[name](images, factors())
    if name == "Posterize":
        masks = [0xFF ^ ((1 << (8 - int(m))) - 1) for m in mags]
        return images & on_device(masks, images.device, torch.uint8).view(-1, 1, 1, 1)
    if name == "Solarize":
        return color.solarize(images, factors(0.0))
    if name == "AutoContrast":
        return color.AutoContrast(p=1.0).fn(images)
    if name == "Equalize":
        return color.Equalize(p=1.0).fn(images)
    raise ValueError(f"unknown op {name!r}")


class _Policy(Op):
    """Per image: a list of (op name, magnitude bin, negative) steps."""

    space: Space = {}
    bins: int = 31

    def _step(self, rng: random.Random, bin_: float | None) -> tuple[str, float, bool]:
        name = rng.choice(list(self.space))
        magnitude, signed = self.space[name]
        if magnitude is None:
            return name, 0, False
        at = rng.randrange(self.bins) if bin_ is None else bin_
        return name, at, signed and rng.random() < 0.5

    def torch(self, images: Tensor, params: Sequence[Any]) -> Tensor:
        check_uint8(images, self)
        _, _, h, w = images.shape
        out = images.clone()
        for step in range(max((len(p) for p in params), default=0)):
            for name, (magnitude, _) in self.space.items():
                idx = [i for i, p in enumerate(params) if p[step][0] == name]
                if not idx or name == "Identity":
                    continue
                mags = [0.0 if magnitude is None else
                        magnitude(params[i][step][1], self.bins, h, w)
                        * (-1.0 if params[i][step][2] else 1.0) for i in idx]
                where = on_device(idx, images.device)
                out[where] = run_op(name, out[where], mags)
        return out


class RandAugment(_Policy):
    """torchvision's RandAugment: `num_ops` ops drawn uniformly from 14, each at bin
    `magnitude` of `num_magnitude_bins`, the signed ones negated half the time."""

    space = RAND_AUGMENT

    def __init__(self, num_ops: int = 2, magnitude: float = 9, num_magnitude_bins: int = 31,
                 magnitude_std: float = 0.0) -> None:
        if not 0 <= magnitude <= num_magnitude_bins - 1:
            raise ValueError(f"RandAugment magnitude={magnitude}: must be in "
                             f"[0, {num_magnitude_bins - 1}]")
        self.num_ops, self.magnitude, self.bins = num_ops, magnitude, num_magnitude_bins
        # timm's mstd: each op's magnitude drawn from N(magnitude, std), clipped to the bins
        self.magnitude_std = magnitude_std

    def _magnitude(self, rng: random.Random) -> float:
        if self.magnitude_std <= 0:
            return self.magnitude
        return min(max(rng.gauss(self.magnitude, self.magnitude_std), 0.0), self.bins - 1.0)

    def draw(self, rng: random.Random) -> list[tuple[str, float, bool]]:
        return [self._step(rng, self._magnitude(rng)) for _ in range(self.num_ops)]


class TrivialAugmentWide(_Policy):
    """torchvision's TrivialAugmentWide: one op drawn uniformly from 14, at a bin drawn
    uniformly from `num_magnitude_bins`, the signed ones negated half the time."""

    space = TRIVIAL_AUGMENT_WIDE

    def __init__(self, num_magnitude_bins: int = 31) -> None:
        self.bins = num_magnitude_bins

    def draw(self, rng: random.Random) -> list[tuple[str, float, bool]]:
        return [self._step(rng, None)]
