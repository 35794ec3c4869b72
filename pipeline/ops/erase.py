"""RandomErasing: torchvision's box, drawn in pixels of the image it is applied to.

torchvision draws the box in `get_params` from the image's own height and width (ten tries
of an area and an aspect ratio, the first that fits strictly inside). The box depends on the
size, which `draw` does not see, so `draw` keeps only what is the sample's own: whether it is
erased (p), and a seed. `torch` runs get_params from that seed at the batch's size (`box`),
so a sample gets torchvision's box for the size it has, the same in any batch, on any rank;
a sample resized between two runs gets another box, as it would in torchvision.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor  # in the class below, `torch` is also the method of the op

from shardflow.ops.base import Op, check_uint8, on_device, put_rows, rows

Box = tuple[int, int, int, int]  # top, left, height, width
Fill = int | tuple[int, ...] | str


def erase_box(rng: random.Random, height: int, width: int, scale: tuple[float, float],
              ratio: tuple[float, float]) -> Box | None:
    """torchvision's RandomErasing.get_params: ten tries of an area uniform in `scale` of
    the image and an aspect ratio (height / width) log-uniform in `ratio`; the first box
    strictly smaller than the image on both sides, at a uniform position; None (the image
    left as it is) when none of the ten fits."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        erase_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        h = int(round(math.sqrt(erase_area * aspect)))
        w = int(round(math.sqrt(erase_area / aspect)))
        if not (h < height and w < width):
            continue
        return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    return None


def hashed_noise(seeds: Tensor, shape: tuple[int, int, int]) -> Tensor:
    """uint8 (n, C, H, W) noise, uniform over 0..255, a function of each image's 32-bit seed
    (int64 (n, 1, 1, 1)) and the pixel's index alone: a 32-bit integer hash (two rounds of
    xor-shift-multiply) in int64 arithmetic that never overflows, so the same values on any
    device and in any batch (a torch.Generator's stream differs between CPU and CUDA, and
    one per image would be a call per image)."""
    mask = 0xFFFFFFFF
    index = torch.arange(math.prod(shape), device=seeds.device).view(1, *shape)
    x = (index * 0x9E3779B1 + seeds).bitwise_and_(mask)  # < 2**63 under 2**31 pixels
    for _ in range(2):  # in place: a third less time than fresh tensors (1.2 ms at 224)
        x.bitwise_xor_(x >> 16).mul_(0x45D9F3B).bitwise_and_(mask)
    return x.bitwise_xor_(x >> 16).to(torch.uint8)  # the low byte


def box_mask(boxes: Sequence[Box], height: int, width: int, device: torch.device
             ) -> torch.Tensor:
    """bool (k, 1, H, W), True inside each image's box: broadcast comparisons of the rows
    and columns against the boxes' edges, one pass for the batch."""
    edges = on_device(list(boxes), device, torch.int64).view(-1, 4, 1, 1)
    top, left, h, w = edges.unbind(1)  # each (k, 1, 1)
    ys = torch.arange(height, device=device).view(1, height, 1)
    xs = torch.arange(width, device=device).view(1, 1, width)
    return ((ys >= top) & (ys < top + h) & (xs >= left) & (xs < left + w)).unsqueeze(1)


def _check_fill(value: Fill) -> None:
    if value == "random":
        return
    fills = (value,) if isinstance(value, int) else value
    if isinstance(fills, str) or not all(isinstance(v, int) and 0 <= v <= 255 for v in fills):
        raise ValueError(f"RandomErasing value={value!r}: an int 0..255, one a channel, or "
                         "'random'")


def _fill(value: Fill, seeds: list[int], shape: tuple[int, int, int], device: torch.device
          ) -> torch.Tensor:
    """What the erased images' boxes get: (k, C, H, W) noise or (1, C or 1, 1, 1) values."""
    if value == "random":
        noise_seeds = on_device([s >> 32 for s in seeds], device, torch.int64)
        return hashed_noise(noise_seeds.view(-1, 1, 1, 1), shape)
    fills = [value] if isinstance(value, int) else list(value)
    if len(fills) not in (1, shape[0]):
        raise ValueError(f"RandomErasing value={value!r}: one value or one for each of the "
                         f"{shape[0]} channels")
    return on_device(fills, device, torch.uint8).view(1, -1, 1, 1)


class RandomErasing(Op):
    """torchvision's RandomErasing on uint8 images: with probability p, a box of `scale` of
    the area and aspect ratio in `ratio` (see erase_box) set to `value`: an int for every
    channel, one int a channel, or "random".

    The value is in levels of the uint8 image. torchvision's recipes erase after Normalize,
    where value=0 is the mean colour: here that is value=(124, 116, 104) (ImageNet's mean in
    levels), and 0 is black. "random" differs too: torchvision fills with standard normal
    noise, meant for a normalized float image; a uint8 image gets noise uniform over 0..255
    instead, hashed from the sample's seed (hashed_noise), the same on the CPU and a GPU.
    """

    def __init__(self, p: float = 0.5, scale: tuple[float, float] = (0.02, 0.33),
                 ratio: tuple[float, float] = (0.3, 3.3), value: Fill = 0) -> None:
        if not 0 <= p <= 1 or not 0 <= scale[0] <= scale[1] <= 1 or not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"RandomErasing(p={p}, scale={scale}, ratio={ratio}): need "
                             "0 <= p <= 1, 0 <= scale low <= high <= 1, 0 < ratio low <= high")
        _check_fill(value)
        self.p, self.value = p, value
        self.scale, self.ratio = (scale[0], scale[1]), (ratio[0], ratio[1])

    def draw(self, rng: random.Random) -> int | None:
        if rng.random() >= self.p:  # torchvision erases when torch.rand(1) < p
            return None
        return rng.getrandbits(64)  # the box and the noise, at the size `torch` gets

    def box(self, seed: int, height: int, width: int) -> Box | None:
        """The box a sample's parameter erases in an image of height x width."""
        return erase_box(random.Random(seed), height, width, self.scale, self.ratio)

    def torch(self, images: Tensor, params: Sequence[Any]) -> Tensor:
        check_uint8(images, self)
        n, c, h, w = images.shape
        drawn = {i: self.box(seed, h, w) for i, seed in enumerate(params) if seed is not None}
        boxes = {i: b for i, b in drawn.items() if b is not None}  # the others fit no box
        idx = list(boxes)
        if not idx:
            return images
        device = images.device
        inside = box_mask(list(boxes.values()), h, w, device)
        fill = _fill(self.value, [params[i] for i in idx], (c, h, w), device)
        if len(idx) == n:
            return torch.where(inside, fill, images)
        return put_rows(images.clone(), idx, torch.where(inside, fill, rows(images, idx)))
