"""Window ops: the crop that makes a view, torchvision's RandomResizedCrop and CenterCrop.

Inside a loader they do not run on pixels: the first op of a view (image_loader's `views`)
gives that view's window, which the decoder reads (region-of-interest decode) and the loader
resizes to the op's `size`, as it does its own crop (image/augment.py's window maths, the one
both use). Outside a loader, `torch` crops and resizes a uint8 batch (antialiased bilinear,
the loader's resize), each image's window drawn from its own generator.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor  # in the ops, `torch` is also a method

from shardflow.ops.base import Op, check_uint8, to_uint8

Window = tuple[int, int, int, int]  # x, y, width, height


class WindowOp(Op):
    """An op that chooses a window of the image and resizes it to `size` x `size`."""

    size: int

    def window(self, rng: random.Random, width: int, height: int) -> Window:
        """The window of an image of `width` x `height` (upright), drawn from `rng`."""
        raise NotImplementedError

    def draw(self, rng: random.Random) -> int:
        # The window needs the image's size: `torch` draws it from a generator seeded here.
        return rng.getrandbits(64)

    def torch(self, images: Tensor, params: Sequence[Any]) -> Tensor:
        check_uint8(images, self)
        out = [F.interpolate(crop.float(), size=(self.size, self.size), mode="bilinear",
                             antialias=True, align_corners=False)
               for crop in self._crops(images, params)]
        return to_uint8(torch.cat(out).round_().clamp_(0, 255))

    def mask(self, masks: Tensor, params: Sequence[Any]) -> Tensor:
        """The same windows, resized by nearest neighbour (the pixel centres the image's
        resize maps); a float map (depth) bilinearly, as the images."""
        size = (self.size, self.size)
        out = [F.interpolate(crop, size=size, mode="bilinear", antialias=True,
                             align_corners=False) if masks.is_floating_point() else
               F.interpolate(crop.float(), size=size, mode="nearest-exact")
               for crop in self._crops(masks, params)]
        return torch.cat(out).to(masks.dtype)

    def _crops(self, images: Tensor, params: Sequence[Any]) -> list[Tensor]:
        h, w = images.shape[-2:]
        crops = []
        for image, seed in zip(images, params, strict=True):
            x, y, cw, ch = self.window(random.Random(seed), w, h)
            crops.append(image[None, :, y:y + ch, x:x + cw])
        return crops


class RandomResizedCrop(WindowOp):
    """torchvision's RandomResizedCrop: a window of `scale` of the area and a log-uniform
    aspect ratio in `ratio` (ten tries, then the largest central window within `ratio`),
    resized to `size`. No flip: add ops.Flip() after it."""

    def __init__(self, size: int, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        if size < 1 or not 0 < scale[0] <= scale[1] <= 1 or not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"RandomResizedCrop(size={size}, scale={scale}, ratio={ratio}): "
                             "need size >= 1, 0 < scale low <= high <= 1, 0 < ratio low <= "
                             "high")
        self.size, self.scale, self.ratio = size, tuple(scale), tuple(ratio)

    def window(self, rng: random.Random, width: int, height: int) -> Window:
        from shardflow.image.augment import random_window

        return random_window(rng, width, height, self.scale, self.ratio)  # type: ignore[arg-type]


class CenterCrop(WindowOp):
    """The evaluation crop: a centred square of `fraction` of the shorter side, resized to
    `size` (torchvision's Resize(size / fraction) then CenterCrop(size))."""

    def __init__(self, size: int, fraction: float = 0.875) -> None:
        if size < 1 or not 0 < fraction <= 1:
            raise ValueError(f"CenterCrop(size={size}, fraction={fraction}): need size >= 1 "
                             "and 0 < fraction <= 1")
        self.size, self.fraction = size, fraction

    def window(self, rng: random.Random, width: int, height: int) -> Window:
        from shardflow.image.augment import center_crop

        c = center_crop(width, height, self.fraction)
        return c.x, c.y, c.width, c.height
