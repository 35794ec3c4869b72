"""RandAugment, TrivialAugmentWide and AutoAugment: torchvision's op spaces and draws, per
image.

Each image draws its own ops (a name, a magnitude bin, a sign) from its generator; the torch
form runs the batch one step at a time, each op once over the images that drew it, so a
batch costs at most (steps x 14) batched calls, never a call per image.

    RandAugment(num_ops=2, magnitude=9): num_ops ops, uniformly, at bin `magnitude` of 31
    TrivialAugmentWide(): one op, uniformly, at a bin drawn uniformly
    AutoAugment("imagenet"): one of 25 learned sub-policies, uniformly; each of its two ops
                             with its own probability, at its own bin of 10
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor  # in the classes below, `torch` is also the method of each op

from shardflow.ops import color, geometry
from shardflow.ops.base import Op, check_uint8, on_device

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
# torchvision's AutoAugment._augmentation_space: RandAugment's ranges, Invert for Identity
AUTO_AUGMENT: Space = {**{k: v for k, v in RAND_AUGMENT.items() if k != "Identity"},
                       "Invert": (None, False)}


def _affine(images: Tensor, matrices: list[list[float]]) -> Tensor:
    return geometry.warp(images, matrices)


# The policy ops that move pixels: the ones a mask follows (ops.apply's masks).
GEOMETRIC = frozenset({"ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"})


# The ops a CPU runs image by image within a group: their float temporaries for one image
# of 224 (0.6 MB) stay in the cache, a group's go through memory. Measured over 9 images of
# 224, one core, ms an image: Color 1.67 as a group, 0.62 one by one; Sharpness 2.18, 0.56;
# the others within 10% either way.
IN_CACHE = frozenset({"Color", "Sharpness"})


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
        f, fn = factors(), enhance[name]
        if images.device.type == "cpu" and name in IN_CACHE and len(images) > 1:
            return torch.cat([fn(images[i:i + 1], f[i:i + 1]) for i in range(len(images))])
        return fn(images, f)
    if name == "Posterize":
        masks = [0xFF ^ ((1 << (8 - int(m))) - 1) for m in mags]
        return images & on_device(masks, images.device, torch.uint8).view(-1, 1, 1, 1)
    if name == "Solarize":
        return color.solarize(images, factors(0.0))
    if name == "AutoContrast":
        return color.AutoContrast(p=1.0).fn(images)
    if name == "Equalize":
        return color.Equalize(p=1.0).fn(images)
    if name == "Invert":  # F.invert: 255 - x (AutoAugment's policies use it)
        return 255 - images
    raise ValueError(f"unknown op {name!r}")


Step = tuple[str, float, bool]  # (op name, magnitude bin, negated)


class _Policy(Op):
    """Per image: a list of steps, each (op name, magnitude bin, negative) or None for a
    step that leaves the image as it is (`steps` reads them from a policy's parameter)."""

    space: Space = {}
    bins: int = 31
    whole_batch = True

    def _step(self, rng: random.Random, bin_: float | None) -> Step:
        name = rng.choice(list(self.space))
        magnitude, signed = self.space[name]
        if magnitude is None:
            return name, 0, False
        at = rng.randrange(self.bins) if bin_ is None else bin_
        return name, at, signed and rng.random() < 0.5

    def steps(self, param: Any) -> Sequence[Step | None]:
        """The steps of one image's parameter, in order."""
        return param

    def _signed_magnitude(self, step: Step, h: int, w: int) -> float:
        name, bin_, negative = step
        magnitude = self.space[name][0]
        if magnitude is None:
            return 0.0
        return magnitude(bin_, self.bins, h, w) * (-1.0 if negative else 1.0)

    def torch(self, images: Tensor, params: Sequence[Any]) -> Tensor:
        check_uint8(images, self)
        return self._run(images, params, tuple(self.space))

    def mask(self, masks: Tensor, params: Sequence[Any]) -> Tensor:
        """The steps that move pixels (shears, translations, rotations), on the masks."""
        return self._run(masks, params, tuple(n for n in self.space if n in GEOMETRIC))

    def _run(self, images: Tensor, params: Sequence[Any], names: tuple[str, ...]) -> Tensor:
        """A step at a time, each op once over the images that drew it: (steps x 14) batched
        calls a batch at most, however large (whole_batch: the CPU's chunks would each
        call most ops for one image, and each call's Python holds the GIL the loader's
        other threads wait on)."""
        _, _, h, w = images.shape
        steps = [self.steps(p) for p in params]
        if not len(images):
            return images.clone()
        # each image as a view of the tensor its last op gave: a group's images are copied
        # together once (rows), its results taken back as views, the batch joined at the end
        now = list(images.split(1))
        for step in range(max((len(s) for s in steps), default=0)):
            drew: dict[str, list[tuple[int, Step]]] = {}
            for i, s in enumerate(steps):
                at = s[step] if step < len(s) else None
                if at is not None and at[0] in names and at[0] != "Identity":
                    drew.setdefault(at[0], []).append((i, at))
            for name, group in drew.items():
                mags = [self._signed_magnitude(s, h, w) for _, s in group]
                idx = [i for i, _ in group]
                group_in = now[idx[0]] if len(idx) == 1 else torch.cat([now[i] for i in idx])
                for i, result in zip(idx, run_op(name, group_in, mags).split(1), strict=True):
                    now[i] = result
        return torch.cat(now)


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

    def draw(self, rng: random.Random) -> list[Step]:
        return [self._step(rng, self._magnitude(rng)) for _ in range(self.num_ops)]


class TrivialAugmentWide(_Policy):
    """torchvision's TrivialAugmentWide: one op drawn uniformly from 14, at a bin drawn
    uniformly from `num_magnitude_bins`, the signed ones negated half the time."""

    space = TRIVIAL_AUGMENT_WIDE

    def __init__(self, num_magnitude_bins: int = 31) -> None:
        self.bins = num_magnitude_bins

    def draw(self, rng: random.Random) -> list[Step]:
        return [self._step(rng, None)]


# torchvision's AutoAugment._get_policies: each sub-policy two (op, probability, magnitude
# bin of 10, None for the ops without one), as learned by Cubuk et al. (arXiv:1805.09501).
SubPolicy = tuple[tuple[str, float, int | None], tuple[str, float, int | None]]
AUTO_AUGMENT_POLICIES: dict[str, tuple[SubPolicy, ...]] = {
    "imagenet": (
        (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)),
        (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
        (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
        (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)),
        (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
        (("Equalize", 0.4, None), ("Rotate", 0.8, 8)),
        (("Solarize", 0.6, 3), ("Equalize", 0.6, None)),
        (("Posterize", 0.8, 5), ("Equalize", 1.0, None)),
        (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)),
        (("Equalize", 0.6, None), ("Posterize", 0.4, 6)),
        (("Rotate", 0.8, 8), ("Color", 0.4, 0)),
        (("Rotate", 0.4, 9), ("Equalize", 0.6, None)),
        (("Equalize", 0.0, None), ("Equalize", 0.8, None)),
        (("Invert", 0.6, None), ("Equalize", 1.0, None)),
        (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
        (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
        (("Color", 0.8, 8), ("Solarize", 0.8, 7)),
        (("Sharpness", 0.4, 7), ("Invert", 0.6, None)),
        (("ShearX", 0.6, 5), ("Equalize", 1.0, None)),
        (("Color", 0.4, 0), ("Equalize", 0.6, None)),
        (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
        (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
        (("Invert", 0.6, None), ("Equalize", 1.0, None)),
        (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
        (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
    ),
    "cifar10": (
        (("Invert", 0.1, None), ("Contrast", 0.2, 6)),
        (("Rotate", 0.7, 2), ("TranslateX", 0.3, 9)),
        (("Sharpness", 0.8, 1), ("Sharpness", 0.9, 3)),
        (("ShearY", 0.5, 8), ("TranslateY", 0.7, 9)),
        (("AutoContrast", 0.5, None), ("Equalize", 0.9, None)),
        (("ShearY", 0.2, 7), ("Posterize", 0.3, 7)),
        (("Color", 0.4, 3), ("Brightness", 0.6, 7)),
        (("Sharpness", 0.3, 9), ("Brightness", 0.7, 9)),
        (("Equalize", 0.6, None), ("Equalize", 0.5, None)),
        (("Contrast", 0.6, 7), ("Sharpness", 0.6, 5)),
        (("Color", 0.7, 7), ("TranslateX", 0.5, 8)),
        (("Equalize", 0.3, None), ("AutoContrast", 0.4, None)),
        (("TranslateY", 0.4, 3), ("Sharpness", 0.2, 6)),
        (("Brightness", 0.9, 6), ("Color", 0.2, 8)),
        (("Solarize", 0.5, 2), ("Invert", 0.0, None)),
        (("Equalize", 0.2, None), ("AutoContrast", 0.6, None)),
        (("Equalize", 0.2, None), ("Equalize", 0.6, None)),
        (("Color", 0.9, 9), ("Equalize", 0.6, None)),
        (("AutoContrast", 0.8, None), ("Solarize", 0.2, 8)),
        (("Brightness", 0.1, 3), ("Color", 0.7, 0)),
        (("Solarize", 0.4, 5), ("AutoContrast", 0.9, None)),
        (("TranslateY", 0.9, 9), ("TranslateY", 0.7, 9)),
        (("AutoContrast", 0.9, None), ("Solarize", 0.8, 3)),
        (("Equalize", 0.8, None), ("Invert", 0.1, None)),
        (("TranslateY", 0.7, 9), ("AutoContrast", 0.9, None)),
    ),
    "svhn": (
        (("ShearX", 0.9, 4), ("Invert", 0.2, None)),
        (("ShearY", 0.9, 8), ("Invert", 0.7, None)),
        (("Equalize", 0.6, None), ("Solarize", 0.6, 6)),
        (("Invert", 0.9, None), ("Equalize", 0.6, None)),
        (("Equalize", 0.6, None), ("Rotate", 0.9, 3)),
        (("ShearX", 0.9, 4), ("AutoContrast", 0.8, None)),
        (("ShearY", 0.9, 8), ("Invert", 0.4, None)),
        (("ShearY", 0.9, 5), ("Solarize", 0.2, 6)),
        (("Invert", 0.9, None), ("AutoContrast", 0.8, None)),
        (("Equalize", 0.6, None), ("Rotate", 0.9, 3)),
        (("ShearX", 0.9, 4), ("Solarize", 0.3, 3)),
        (("ShearY", 0.8, 8), ("Invert", 0.7, None)),
        (("Equalize", 0.9, None), ("TranslateY", 0.6, 6)),
        (("Invert", 0.9, None), ("Equalize", 0.6, None)),
        (("Contrast", 0.3, 3), ("Rotate", 0.8, 4)),
        (("Invert", 0.8, None), ("TranslateY", 0.0, 2)),
        (("ShearY", 0.7, 6), ("Solarize", 0.4, 8)),
        (("Invert", 0.6, None), ("Rotate", 0.8, 4)),
        (("ShearY", 0.3, 7), ("TranslateX", 0.9, 3)),
        (("ShearX", 0.1, 6), ("Invert", 0.6, None)),
        (("Solarize", 0.7, 2), ("TranslateY", 0.6, 7)),
        (("ShearY", 0.8, 4), ("Invert", 0.8, None)),
        (("ShearX", 0.7, 9), ("TranslateY", 0.8, 3)),
        (("ShearY", 0.8, 5), ("AutoContrast", 0.7, None)),
        (("ShearX", 0.7, 2), ("Invert", 0.1, None)),
    ),
}


class AutoAugment(_Policy):
    """torchvision's AutoAugment with one of its learned policies ("imagenet", "cifar10",
    "svhn"): a sub-policy drawn uniformly from 25; each of its two ops applied when a uniform
    draw is <= its probability (torchvision's `probs[i] <= p`), at its bin of
    torchvision's 10-bin space (Rotate bin 9: 30 degrees, Posterize bin 8: 4 bits, Solarize
    bin 5: 255 * 4/9), the signed ops negated half the time. The parameter of an image is
    (sub-policy index, [step or None for each of its two ops]): None where the op does not
    apply, so what applied can be read back."""

    space = AUTO_AUGMENT
    bins = 10  # torchvision: self._augmentation_space(10, image_size)

    def __init__(self, policy: str = "imagenet") -> None:
        if policy not in AUTO_AUGMENT_POLICIES:
            raise ValueError(f"AutoAugment policy={policy!r}: use one of "
                             f"{sorted(AUTO_AUGMENT_POLICIES)}")
        self.policy = policy

    def draw(self, rng: random.Random) -> tuple[int, list[Step | None]]:
        table = AUTO_AUGMENT_POLICIES[self.policy]
        index = rng.randrange(len(table))
        steps: list[Step | None] = []
        for name, prob, bin_ in table[index]:
            # both draws made whatever the outcome, as torchvision draws probs and signs
            applies, negative = rng.random() <= prob, rng.random() < 0.5
            signed = self.space[name][1]
            steps.append((name, 0 if bin_ is None else bin_, signed and negative)
                         if applies else None)
        return index, steps

    def steps(self, param: Any) -> Sequence[Step | None]:
        return param[1]
