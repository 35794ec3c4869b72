"""Colour ops, torchvision's definitions over uint8 tensors, batched (each with its own
factor per image). They match PIL's ImageEnhance/ImageOps, which torchvision's ops on PIL
images use, within a level or two: PIL rounds its grey level and its mean where torchvision
truncates (tests/test_ops.py states each tolerance).

    brightness f: f * img                      contrast f:   blend(img, mean grey, f)
    saturation f: blend(img, grey, f)          hue h:        HSV hue + h (turns, mod 1)
    solarize t:   255 - v where v >= t         posterize b:  the top b bits of each value
    autocontrast: each channel stretched to 0..255; equalize: each channel's histogram
    normalize:    float32 (x - mean) / std, the last op (every other op takes uint8)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor  # in the classes below, `torch` is also the method of each op

from shardflow.ops.base import (
    Op,
    check_uint8,
    chosen,
    levels,
    on_device,
    per_sample,
    put_rows,
    rows,
    span,
    through_lut,
    to_uint8,
)

Factor = float | tuple[float, float]


def _uniform(rng: random.Random, factor: Factor) -> float:
    return rng.uniform(*factor) if isinstance(factor, tuple) else float(factor)


def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    return to_uint8(x.clamp(0, 255))  # truncates, as torchvision's tensor ops do


def blend(a: torch.Tensor, b: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """ratio * a + (1 - ratio) * b, clamped to uint8: how PIL's Image.blend enhances (the
    same float operations as torchvision's _blend; the sum and clamp in place)."""
    out = a.float() * ratio
    out += b.float() * (1.0 - ratio)
    return to_uint8(out.clamp_(0, 255))


def grey(images: torch.Tensor) -> torch.Tensor:
    """(N, 1, H, W) grey levels: ITU-R 601-2 luma, as PIL's convert('L') and torchvision."""
    if images.shape[1] == 1:
        return images
    r, g, b = images.unbind(1)  # each channel to float as it is weighed: no float copy
    return to_uint8((0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(1))


def brightness(images: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return through_lut(images, _to_uint8(levels(images) * f.view(-1, 1, 1)))


def contrast(images: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    mean = grey(images).float().mean(dim=(1, 2, 3), keepdim=True)
    return through_lut(images, blend(levels(images), mean.view(-1, 1, 1), f.view(-1, 1, 1)))


def solarize(images: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Each value at or above its image's threshold (float (N, 1, 1, 1)) inverted."""
    v = levels(images)
    return through_lut(images, torch.where(v >= thresholds.view(-1, 1, 1), 255.0 - v, v)
                       .to(torch.uint8))


def saturation(images: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return blend(images, grey(images), f)


def hue(images: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Rotate the hue by `h` turns (-0.5..0.5): through float HSV, back to uint8 as
    torchvision's convert_image_dtype does (x 255.999, truncated)."""
    if images.shape[1] == 1:
        return images
    hsv = rgb_to_hsv(images.float() / 255.0)
    hsv = torch.cat([(hsv[:, :1] + h) % 1.0, hsv[:, 1:]], dim=1)
    return to_uint8(hsv_to_rgb(hsv) * (256.0 - 1e-3))


def rgb_to_hsv(rgb: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) in 0..1 -> hue (turns), saturation, value; grey pixels get hue 0."""
    r, g, b = rgb.unbind(1)
    maxc, minc = rgb.max(dim=1).values, rgb.min(dim=1).values
    flat = maxc == minc
    span = torch.where(flat, torch.ones_like(maxc), maxc - minc)
    s = (maxc - minc) / torch.where(flat, torch.ones_like(maxc), maxc)
    rc, gc, bc = (maxc - r) / span, (maxc - g) / span, (maxc - b) / span
    h = ((maxc == r) * (bc - gc) + ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
         + ((maxc != g) & (maxc != r)) * (4.0 + gc - rc))
    return torch.stack([torch.fmod(h / 6.0 + 1.0, 1.0), s, maxc], dim=1)


def hsv_to_rgb(hsv: torch.Tensor) -> torch.Tensor:
    h, s, v = hsv.unbind(1)
    sector = torch.floor(h * 6.0)
    f = h * 6.0 - sector
    p = (v * (1.0 - s)).clamp(0, 1)
    q = (v * (1.0 - s * f)).clamp(0, 1)
    t = (v * (1.0 - s * (1.0 - f))).clamp(0, 1)
    sector = sector.to(torch.int64) % 6
    # per sector, which of (v, q, p, t) each channel takes: the usual six-case table
    table = torch.stack([torch.stack(c, dim=1) for c in (
        (v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))], dim=1)
    return table.gather(1, sector[:, None, None].expand(-1, 1, 3, -1, -1)).squeeze(1)


class _Enhance(Op):
    """A factor per image, fixed or drawn uniformly from (low, high)."""

    fn: Any = None

    def __init__(self, factor: Factor, p: float = 1.0) -> None:
        self.factor, self.p = factor, p

    def draw(self, rng: random.Random) -> float | None:
        if self.p < 1.0 and rng.random() >= self.p:
            return None
        return _uniform(rng, self.factor)

    def torch(self, images: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        check_uint8(images, self)
        return per_sample(images, params, type(self).fn)


class _FactorInGraph(_Enhance):
    """An enhance op whose DALI form takes the factor per sample (1: the identity)."""

    dali_inputs = {"factor": ("FLOAT", 0)}

    def dali_values(self, params: Sequence[Any], height: int, width: int
                    ) -> dict[str, list[Any]]:
        import numpy as np

        return {"factor": [np.float32(1.0 if p is None else p) for p in params]}


class Brightness(_FactorInGraph):
    """PIL's ImageEnhance.Brightness: 0 black, 1 the image. DALI form: fn.brightness (it
    rounds to the nearest level where torch truncates: a level apart at most)."""

    fn = staticmethod(brightness)

    def dali(self, images: Any, inputs: dict[str, Any]) -> Any:
        from nvidia.dali import fn

        return fn.brightness(images, brightness=inputs["factor"])


class Contrast(_Enhance):
    """PIL's ImageEnhance.Contrast: 0 the image's mean grey, 1 the image. No DALI form:
    fn.brightness_contrast's centre is a per-sample argument, which a GPU graph cannot
    compute from its own images (their mean is on the device)."""

    fn = staticmethod(contrast)


class Saturation(_FactorInGraph):
    """PIL's ImageEnhance.Color: 0 grey, 1 the image. DALI form: fn.color_twist's saturation,
    the same blend with the grey, but with the grey unrounded and the result rounded to the
    nearest level: two levels apart at most (at low factors, where the grey weighs most)."""

    fn = staticmethod(saturation)

    def dali(self, images: Any, inputs: dict[str, Any]) -> Any:
        from nvidia.dali import fn

        return fn.color_twist(images, saturation=inputs["factor"])


class Hue(_Enhance):
    """torchvision's adjust_hue: the hue turned by the factor, in turns (-0.5..0.5). No DALI
    form: fn.hsv turns the hue in YIQ space, not HSV (measured up to 159 levels apart)."""

    fn = staticmethod(hue)


class ColorJitter(Op):
    """torchvision's ColorJitter: brightness, contrast and saturation factors drawn from
    [max(0, 1 - x), 1 + x], hue from [-h, h], applied in an order drawn per image."""

    def __init__(self, brightness: float | tuple[float, float] = 0.0,
                 contrast: float | tuple[float, float] = 0.0,
                 saturation: float | tuple[float, float] = 0.0,
                 hue: float | tuple[float, float] = 0.0) -> None:
        """Each a number x (factors in [max(0, 1 - x), 1 + x]; hue in [-x, x]) or a (min,
        max) pair, as torchvision takes them."""
        self.brightness, self.contrast, self.saturation, self.hue = (
            brightness, contrast, saturation, hue)
        lowest, highest = self._ranges()[3] or (0.0, 0.0)
        if not -0.5 <= lowest <= highest <= 0.5:
            raise ValueError(f"ColorJitter hue={hue}: must lie in [-0.5, 0.5]")

    def _ranges(self) -> list[tuple[float, float] | None]:
        around_one = [span(x, self, name, centre=1.0, low=0.0) if x else None
                      for name, x in (("brightness", self.brightness),
                                      ("contrast", self.contrast),
                                      ("saturation", self.saturation))]
        return [*around_one, span(self.hue, self, "hue") if self.hue else None]

    def draw(self, rng: random.Random) -> tuple[list[int], list[float | None]]:
        order = rng.sample(range(4), 4)
        return order, [rng.uniform(*r) if r else None for r in self._ranges()]

    def torch(self, images: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        check_uint8(images, self)
        fns = (brightness, contrast, saturation, hue)
        for step in range(4):  # at most 16 batched calls, whatever the batch
            for kind, fn in enumerate(fns):
                at_step = [factors[kind] if order[step] == kind else None
                           for order, factors in params]
                images = per_sample(images, at_step, fn)
        return images


class Grayscale(Op):
    """torchvision's RandomGrayscale: with probability p, the grey level in every channel."""

    def __init__(self, p: float = 0.1) -> None:
        self.p = p

    def draw(self, rng: random.Random) -> bool | None:
        return True if rng.random() < self.p else None

    def torch(self, images: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        check_uint8(images, self)
        return _where(images, params, lambda x: grey(x).expand_as(x))


def _where(images: torch.Tensor, params: Sequence[Any], fn: Any) -> torch.Tensor:
    """fn over the chosen images (a parameter-free op), the rest as they are."""
    idx = chosen(params)
    if not idx:
        return images
    if len(idx) == len(images):
        return fn(images).contiguous()
    return put_rows(images.clone(), idx, fn(rows(images, idx)))


class _Maybe(Op):
    """An op without a per-image value, applied with probability p."""

    def draw(self, rng: random.Random) -> bool | None:
        return True if self.p >= 1.0 or rng.random() < self.p else None

    def torch(self, images: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        check_uint8(images, self)
        return _where(images, params, self.fn)

    def fn(self, images: Tensor) -> Tensor:
        raise NotImplementedError


class Solarize(_Maybe):
    """PIL's ImageOps.solarize: every value at or above `threshold` inverted."""

    def __init__(self, threshold: int = 128, p: float = 0.5) -> None:
        self.threshold, self.p = threshold, p

    def fn(self, images: torch.Tensor) -> torch.Tensor:
        return solarize(images, torch.full((1, 1, 1, 1), float(self.threshold),
                                           device=images.device))


class Posterize(_Maybe):
    """PIL's ImageOps.posterize: only the top `bits` bits of each value kept."""

    def __init__(self, bits: int = 4, p: float = 0.5) -> None:
        if not 0 <= bits <= 8:
            raise ValueError(f"Posterize bits={bits}: must be in [0, 8]")
        self.bits, self.p = bits, p

    def fn(self, images: torch.Tensor) -> torch.Tensor:
        return images & (0xFF ^ ((1 << (8 - self.bits)) - 1))


class AutoContrast(_Maybe):
    """PIL's ImageOps.autocontrast (no cutoff): each channel stretched to 0..255; a flat
    channel is left as it is."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def fn(self, images: torch.Tensor) -> torch.Tensor:
        lo = images.amin(dim=(2, 3), keepdim=True).float()
        hi = images.amax(dim=(2, 3), keepdim=True).float()
        flat = hi <= lo
        scale = torch.where(flat, torch.ones_like(hi), 255.0 / (hi - lo).clamp(min=1))
        lo = torch.where(flat, torch.zeros_like(lo), lo)
        n, c = images.shape[:2]
        return through_lut(images, _to_uint8((levels(images) - lo.view(n, c, 1))
                                             * scale.view(n, c, 1)))


class Equalize(_Maybe):
    """PIL's ImageOps.equalize: each channel through the lookup table of its histogram (a
    channel of one value, or too few pixels to spread, is left as it is)."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def fn(self, images: torch.Tensor) -> torch.Tensor:
        n, c, h, w = images.shape
        hist = _histograms(images)
        # the top value's count: the last bin that is not empty
        top = ((hist > 0) * torch.arange(256, device=images.device)).amax(dim=1, keepdim=True)
        last = hist.gather(1, top)
        step = (h * w - last) // 255
        cum = torch.cumsum(hist, dim=1) - hist  # pixels below each value
        lut = ((cum + step // 2) // step.clamp(min=1)).clamp(0, 255)
        lut = torch.where(step > 0, lut, torch.arange(256, device=images.device))
        return through_lut(images, lut.to(torch.uint8).view(n, c, 256))


def _histograms(images: torch.Tensor) -> torch.Tensor:
    """int64 (N * C, 256): each image's channel histograms. On the CPU one bincount of the
    uint8 plane each (no int64 copy of the pixels: 10x faster than one bincount over an
    offset index); on a GPU one scatter_add (CUDA's bincount reads the index's min and max
    back to the host: two syncs)."""
    n, c, h, w = images.shape
    if images.device.type == "cpu":
        if n * c == 0:
            return torch.zeros((0, 256), dtype=torch.long)
        planes = images.contiguous().view(n * c, h * w)
        return torch.stack([torch.bincount(p, minlength=256) for p in planes])
    flat = images.reshape(n * c, h * w).long()
    rows = torch.arange(n * c, device=images.device).unsqueeze(1)
    index = (flat + 256 * rows).reshape(-1)
    hist = torch.zeros(256 * n * c, dtype=torch.long, device=images.device)
    hist.scatter_add_(0, index, torch.ones_like(index))
    return hist.reshape(n * c, 256)


class Normalize(Op):
    """torchvision's Normalize on a uint8 batch: float32 (x - mean) / std per channel, mean
    and std in 0..255 units as the loaders take them (shardflow.image.graph.IMAGENET_MEAN:
    0.485 * 255, ...), i.e. torchvision's ToTensor then Normalize(mean / 255, std / 255).
    torchvision's own 0..1 values (every mean at most 1, every std under 1) are taken as
    such: a spread under 1 level in 255 would leave nothing to see, so the units cannot be
    confused (mean 0, std 1 is the identity in either).

    The last op of a recipe: it returns floats, and every op refuses what is not uint8
    (check_uint8), so an op after it raises. image_loader normalizes after its ops itself
    (its mean and std): this op is for ops.apply outside a loader. It draws nothing, so
    adding it changes no other op's draws."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        if len(mean) != len(std) or len(mean) not in (1, 3) or min(std) <= 0:
            raise ValueError(f"Normalize(mean={mean}, std={std}): one or three of each, the "
                             "stds positive")
        self.mean, self.std = tuple(mean), tuple(std)

    def draw(self, rng: random.Random) -> bool:
        return True  # every sample, and no draw from its generator

    def torch(self, images: Tensor, params: Sequence[Any]) -> Tensor:
        check_uint8(images, self)
        if len(self.mean) not in (1, images.shape[1]):
            raise ValueError(f"{self!r}: {len(self.mean)} means for {images.shape[1]} channels")
        unit = 255.0 if max(self.mean) <= 1 and max(self.std) < 1 else 1.0  # see above
        mean = on_device([m * unit for m in self.mean], images.device,
                         torch.float32).view(1, -1, 1, 1)
        std = on_device([v * unit for v in self.std], images.device,
                        torch.float32).view(1, -1, 1, 1)
        return (images.float() - mean) / std
