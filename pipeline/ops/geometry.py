"""Geometric ops, torchvision's definitions over uint8 tensors, batched: one affine matrix
per image, applied by one grid_sample over the batch (nearest neighbour, zeros outside),
with torchvision's pixel-centre convention, so they match PIL's Image.transform.

An op's drawn parameters do not depend on the image's size (a translation is drawn as a
share of the side, as torchvision's RandomAffine draws it); the torch form turns them into
pixels for the batch it gets, rounding a translation to whole pixels as torchvision does.

The filters live here too: Sharpness (PIL's smoothing kernel) and GaussianBlur
(torchvision's, one sigma per image as a grouped convolution over the batch).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import Tensor  # in the classes below, `torch` is also the method of each op

from shardflow.ops.base import (
    Op,
    check_uint8,
    chosen,
    on_device,
    per_sample,
    put_rows,
    rows,
    span,
    to_uint8,
)
from shardflow.ops.color import blend


def inverse_affine(angle: float, translate: tuple[float, float], scale: float,
                   shear: tuple[float, float], center: tuple[float, float] = (0.0, 0.0)
                   ) -> list[float]:
    """torchvision's _get_inverse_affine_matrix: the 2x3 matrix from output to input
    coordinates (relative to `center`) of rotating by `angle` degrees clockwise, shearing by
    `shear` degrees (x, y), scaling and translating (pixels)."""
    rot, sx, sy = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    cx, cy = center
    tx, ty = translate
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    m = [x / scale for x in (d, -b, 0.0, -c, a, 0.0)]
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty) + cx
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty) + cy
    return m


def warp(images: torch.Tensor, matrices: Sequence[Sequence[float]]) -> torch.Tensor:
    """Each image through its inverse matrix (coordinates relative to the image's centre,
    output pixel centres at +0.5), nearest neighbour, 0 outside: torchvision's tensor
    affine, batched. On a GPU one grid_sample over a float copy; on the CPU a gather of the
    nearest pixels (_gather_warp), 5-10x faster there. A float tensor (a depth map warped
    with its image) is bilinear, by grid_sample on either."""
    if images.is_floating_point():  # maps of continuous values (depth): bilinear
        return _grid_warp(images, matrices, "bilinear")
    if images.device.type == "cpu":
        return _gather_warp(images, matrices)
    return _grid_warp(images, matrices)


def _grid_warp(images: torch.Tensor, matrices: Sequence[Sequence[float]],
               mode: str = "nearest") -> torch.Tensor:
    """`warp` as torchvision's tensor affine runs it: grid_sample over a float copy (`mode`
    "bilinear" for maps of continuous values)."""
    n, _, h, w = images.shape
    theta = on_device(matrices, images.device, torch.float32).view(n, 2, 3)
    xs = torch.arange(w, dtype=torch.float32, device=images.device) + 0.5 - w / 2
    ys = torch.arange(h, dtype=torch.float32, device=images.device) + 0.5 - h / 2
    base = torch.stack([xs.expand(h, w), ys[:, None].expand(h, w), torch.ones(h, w,
                        device=images.device)], dim=-1).view(1, h * w, 3)
    scale = on_device([0.5 * w, 0.5 * h], images.device, torch.float32)
    grid = base.expand(n, -1, -1).bmm(theta.transpose(1, 2)) / scale
    out = F.grid_sample(images.float(), grid.view(n, h, w, 2), mode=mode,
                        padding_mode="zeros", align_corners=False)
    # nearest: the values are the input's, exactly (float32 holds a 16-bit mask's too)
    return out.to(images.dtype)


def _source_index(matrices: Sequence[Sequence[float]], h: int, w: int) -> torch.Tensor:
    """int64 (n, h * w): for each output pixel, the flat index of its nearest source pixel
    in the image padded by a ring of zeros ((h + 2) x (w + 2)); a source off the image
    lands on the ring. grid_sample's nearest in pixel units: round half to even of the
    matrix's point + side / 2 - 0.5 (a float rounding apart where a source lies within
    ~1e-5 of a half: a pixel in 1e5 takes its neighbour, as between any two warps)."""
    t = torch.tensor(matrices, dtype=torch.float32).view(-1, 2, 3, 1, 1)
    xs = (torch.arange(w, dtype=torch.float32) + 0.5 - w / 2).view(1, w)
    ys = (torch.arange(h, dtype=torch.float32) + 0.5 - h / 2).view(h, 1)
    # x and y of each pixel's source: a column part plus a row part, one pass each
    sx = (t[:, 0, 0] * xs) + (t[:, 0, 1] * ys + t[:, 0, 2] + (w / 2 - 0.5))
    sy = (t[:, 1, 0] * xs) + (t[:, 1, 1] * ys + t[:, 1, 2] + (h / 2 - 0.5))
    sx.round_().clamp_(-1, w)
    sy.round_().clamp_(-1, h)
    if (h + 2) * (w + 2) < 2 ** 24:  # whole numbers float32 holds exactly: no int64 passes
        return sy.mul_(w + 2).add_(sx).add_(w + 3).to(torch.int64).view(len(t), h * w)
    ix, iy = sx.to(torch.int64).add_(1), sy.to(torch.int64).add_(1)
    return iy.mul_(w + 2).add_(ix).view(len(t), h * w)


def _gather_warp(images: torch.Tensor, matrices: Sequence[Sequence[float]]) -> torch.Tensor:
    """`warp` on the CPU: the images copied into a zero-ringed HWC buffer, each output
    pixel taken from its source index (numpy's take, a whole pixel at a time: an RGB(A)
    uint8 pixel as one 4-byte word). grid_sample over a float copy measured 1.2-2.5 ms an
    image of 224 here, this 0.3 (half of it the copy into the ring)."""
    import numpy as np

    n, c, h, w = images.shape
    index = _source_index(matrices, h, w).numpy()
    words = images.dtype == torch.uint8 and c <= 4
    ring = torch.zeros((n, h + 2, w + 2, 4 if words else c), dtype=images.dtype)
    ring[:, 1:-1, 1:-1, :c] = images.permute(0, 2, 3, 1)
    if words:  # RGBA words; the output's 4th byte is dropped by the view below
        src = ring.view(torch.int32).numpy().reshape(n, -1)
        out = torch.empty((n, h * w), dtype=torch.int32)
        dst = out.numpy()
        for i in range(n):
            np.take(src[i], index[i], out=dst[i])
        return out.view(torch.uint8).view(n, h, w, 4)[..., :c].permute(0, 3, 1, 2)
    pixels, picked = ring.numpy().reshape(n, -1, c), np.empty((n, h * w, c), ring.numpy().dtype)
    for i in range(n):
        np.take(pixels[i], index[i], axis=0, out=picked[i])
    return torch.from_numpy(picked).view(n, h, w, c).permute(0, 3, 1, 2)


def shift(images: torch.Tensor, moves: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Each image moved by whole pixels (dx right, dy down), 0 where nothing comes in: what
    `warp` gives for a whole-pixel translation, as one copy per image instead of a float
    grid_sample (on the CPU; a GPU loops on no image and warps)."""
    out = torch.zeros_like(images)
    h, w = images.shape[-2:]
    for i, (dx, dy) in enumerate(moves):
        if abs(dx) >= w or abs(dy) >= h:
            continue
        out[i, :, max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
            images[i, :, max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


def _warp_chosen(images: Tensor, params: Sequence[Any], matrix: Any) -> Tensor:
    idx = chosen(params)
    if not idx:
        return images
    h, w = images.shape[-2:]
    matrices = [matrix(params[i], h, w) for i in idx]
    if len(idx) == len(images):
        return warp(images, matrices)
    return put_rows(images.clone(), idx, warp(rows(images, idx), matrices))


def dali_matrices(params: Sequence[Any], height: int, width: int, matrix: Any
                  ) -> list[np.ndarray]:
    """fn.warp_affine's destination -> source matrices (pixel-corner coordinates) of `warp`'s
    centre-relative inverse ones: src = A dst + (t + c - A c), c the image's centre; the
    identity where a parameter is None."""
    out = []
    for p in params:
        if p is None:
            out.append(np.array([[1, 0, 0], [0, 1, 0]], np.float32))
            continue
        a, b, t0, c, d, t1 = matrix(p, height, width)
        cx, cy = width / 2, height / 2
        out.append(np.array([[a, b, t0 + cx - (a * cx + b * cy)],
                             [c, d, t1 + cy - (c * cx + d * cy)]], np.float32))
    return out


def dali_warp(images: Any, matrices: Any) -> Any:
    """The DALI form of `warp`: nearest neighbour, 0 outside."""
    from nvidia.dali import fn, types

    return fn.warp_affine(images, matrix=matrices, fill_value=0.0,
                          interp_type=types.DALIInterpType.INTERP_NN)


class Flip(Op):
    """torchvision's RandomHorizontalFlip (vertical=True: RandomVerticalFlip)."""

    def __init__(self, p: float = 0.5, vertical: bool = False) -> None:
        self.p, self.vertical = p, vertical

    def draw(self, rng: random.Random) -> bool | None:
        return True if rng.random() < self.p else None

    def torch(self, images: Tensor, params: Sequence[Any]) -> Tensor:
        check_uint8(images, self)
        return self.mask(images, params)

    dali_inputs = {"flip": ("INT32", 0)}

    def dali_values(self, params: Sequence[Any], height: int, width: int
                    ) -> dict[str, list[Any]]:
        return {"flip": [np.int32(p is not None) for p in params]}

    def dali(self, images: Any, inputs: dict[str, Any]) -> Any:
        from nvidia.dali import fn

        if self.vertical:
            return fn.flip(images, horizontal=0, vertical=inputs["flip"])
        return fn.flip(images, horizontal=inputs["flip"], vertical=0)

    def mask(self, masks: Tensor, params: Sequence[Any]) -> Tensor:
        flipped = on_device([q is not None for q in params], masks.device, torch.bool)
        dim = 2 if self.vertical else 3
        return torch.where(flipped.view(-1, 1, 1, 1), masks.flip(dim), masks)


class _Warp(Op):
    """An op that moves pixels by an inverse affine matrix a sample (`matrix`): `warp` in
    torch, for images and masks alike (nearest neighbour: labels stay labels), and
    fn.warp_affine in a DALI graph."""

    dali_inputs = {"matrix": ("FLOAT", 2)}

    @staticmethod
    def matrix(param: Any, h: int, w: int) -> list[float]:
        raise NotImplementedError

    def torch(self, images: Tensor, params: Sequence[Any]) -> Tensor:
        check_uint8(images, self)
        return self.mask(images, params)

    def mask(self, masks: Tensor, params: Sequence[Any]) -> Tensor:
        return _warp_chosen(masks, params, self.matrix)

    def dali_values(self, params: Sequence[Any], height: int, width: int
                    ) -> dict[str, list[Any]]:
        return {"matrix": dali_matrices(params, height, width, self.matrix)}

    def dali(self, images: Any, inputs: dict[str, Any]) -> Any:
        return dali_warp(images, inputs["matrix"])


class Affine(_Warp):
    """torchvision's RandomAffine: angle uniform in (-degrees, degrees) clockwise, a
    translation of up to translate = (x, y) of the sides, a scale in `scale`, a shear in
    `shear` degrees ((x_lo, x_hi) or (x_lo, x_hi, y_lo, y_hi)), about the centre."""

    def __init__(self, degrees: float | tuple[float, float] = 0.0,
                 translate: tuple[float, float] | None = None,
                 scale: tuple[float, float] | None = None,
                 shear: tuple[float, ...] | None = None) -> None:
        span(degrees, self, "degrees")  # refused here, not at the first batch
        self.degrees, self.translate, self.scale, self.shear = degrees, translate, scale, shear

    def draw(self, rng: random.Random) -> tuple[float, float, float, float, float, float]:
        angle = rng.uniform(*span(self.degrees, self, "degrees"))
        tx, ty = ((rng.uniform(-self.translate[0], self.translate[0]),
                   rng.uniform(-self.translate[1], self.translate[1]))
                  if self.translate else (0.0, 0.0))
        scale = rng.uniform(*self.scale) if self.scale else 1.0
        shear = self.shear or (0.0, 0.0)
        sx = rng.uniform(shear[0], shear[1])
        sy = rng.uniform(shear[2], shear[3]) if len(shear) == 4 else 0.0
        return angle, tx, ty, scale, sx, sy

    @staticmethod
    def matrix(p: Any, h: int, w: int) -> list[float]:
        angle, tx, ty, scale, sx, sy = p
        return inverse_affine(angle, (float(round(tx * w)), float(round(ty * h))), scale,
                              (sx, sy))


class Rotate(_Warp):
    """torchvision's RandomRotation: an angle uniform in (-degrees, degrees),
    counter-clockwise, about the centre, zeros where nothing maps."""

    def __init__(self, degrees: float | tuple[float, float]) -> None:
        span(degrees, self, "degrees")
        self.degrees = degrees

    def draw(self, rng: random.Random) -> float:
        return rng.uniform(*span(self.degrees, self, "degrees"))

    @staticmethod
    def matrix(angle: float, h: int, w: int) -> list[float]:
        return inverse_affine(-angle, (0.0, 0.0), 1.0, (0.0, 0.0))


def sharpness(images: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """PIL's ImageEnhance.Sharpness: blend with the image smoothed by PIL's SMOOTH kernel
    ([1 1 1; 1 5 1; 1 1 1] / 13), its border pixels kept. The 3x3 sum in int16 from shifted
    views, rows then columns (no float convolution), rounded as torchvision rounds it: a
    sum over 13 never ends in exactly .5, so (sum + 6) // 13 is that rounding; the division
    as a multiply and shift in int32 ((t * 5042) >> 16 is t // 13 for every t up to
    13 * 255 + 6: 4x faster on the CPU than an integer division)."""
    x = images.to(torch.int16)
    h, w = x.shape[-2:]
    rows = x[..., :, :-2] + x[..., :, 1:-1] + x[..., :, 2:]
    total = rows[..., :-2, :] + rows[..., 1:-1, :] + rows[..., 2:, :]
    total += 4 * x[..., 1:-1, 1:-1] + 6
    smooth = images.clone()
    smooth[..., 1:-1, 1:-1] = ((total.to(torch.int32) * 5042) >> 16).to(torch.uint8)
    return blend(images, smooth, f)


class Sharpness(Op):
    """PIL's ImageEnhance.Sharpness: 0 smoothed, 1 the image, 2 sharpened."""

    def __init__(self, factor: float | tuple[float, float], p: float = 1.0) -> None:
        self.factor, self.p = factor, p

    def draw(self, rng: random.Random) -> float | None:
        if self.p < 1.0 and rng.random() >= self.p:
            return None
        f = self.factor
        return rng.uniform(*f) if isinstance(f, tuple) else float(f)

    def torch(self, images: Tensor, params: Sequence[Any]) -> Tensor:
        check_uint8(images, self)
        return per_sample(images, params, sharpness)


def gaussian_kernels(size: int, sigmas: torch.Tensor) -> torch.Tensor:
    """torchvision's _get_gaussian_kernel1d, one per sigma (float32 (n, ...)): exp(-x^2 /
    (2 sigma^2)) at x = -(size-1)/2 .. (size-1)/2, normalized to sum 1; float32 (n, size)."""
    half = (size - 1) * 0.5
    x = torch.linspace(-half, half, size, dtype=torch.float32, device=sigmas.device)
    pdf = torch.exp(-0.5 * (x / sigmas.view(-1, 1)).pow(2))
    return pdf / pdf.sum(dim=1, keepdim=True)


def gaussian_blur(images: torch.Tensor, kernel_size: tuple[int, int], sigmas: torch.Tensor
                  ) -> torch.Tensor:
    """torchvision's tensor gaussian_blur, one sigma per image (float32 (n, 1, 1, 1)): the
    kernel (kx wide, ky high) the outer product of two 1-D kernels, the image padded by
    half of it in reflect mode, convolved in float32, rounded to uint8. Batched as two 1-D
    convolutions (rows, then columns) with every image's channels as groups, each its
    image's kernel: the same kernel as torchvision's 2-D one, summed in another order (a
    float rounding apart, which moves a value that lands within ~1e-5 of .5 by one)."""
    n, c, h, w = images.shape
    kx, ky = kernel_size
    x = F.pad(images.float().reshape(1, n * c, h, w), [kx // 2, kx // 2, ky // 2, ky // 2],
              mode="reflect")
    # each image's kernel for each of its channels (an expand: repeat_interleave can sync)
    rows = gaussian_kernels(kx, sigmas).view(n, 1, kx).expand(n, c, kx).reshape(n * c, 1, 1, kx)
    cols = gaussian_kernels(ky, sigmas).view(n, 1, ky).expand(n, c, ky).reshape(n * c, 1, ky, 1)
    x = F.conv2d(F.conv2d(x, rows, groups=n * c), cols, groups=n * c)
    # torchvision rounds and casts; a weighted mean of uint8 stays in 0..255 but for float
    # error, which the clamp keeps from wrapping
    return to_uint8(x.round_().clamp_(0, 255)).view(n, c, h, w)


class GaussianBlur(Op):
    """torchvision's GaussianBlur: a sigma drawn uniformly from `sigma` (a float: fixed) for
    each image, its kernel `kernel_size` (odd; an int or (width, height)) and reflect padding
    (gaussian_blur). torchvision's blurs every image; p < 1 is its
    RandomApply([GaussianBlur(...)], p=p), as SimCLR-style recipes use it. Each side of the
    image must be longer than half the kernel, as torchvision's reflect padding needs."""

    def __init__(self, kernel_size: int | tuple[int, int],
                 sigma: float | tuple[float, float] = (0.1, 2.0), p: float = 1.0) -> None:
        kx, ky = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        if kx <= 0 or ky <= 0 or kx % 2 == 0 or ky % 2 == 0:
            raise ValueError(f"GaussianBlur kernel_size={kernel_size}: odd and positive")
        lo, hi = (sigma, sigma) if isinstance(sigma, (int, float)) else sigma
        if not 0 < lo <= hi:
            raise ValueError(f"GaussianBlur sigma={sigma}: positive, (min, max) with min <= max")
        self.kernel_size, self.sigma, self.p = (kx, ky), (float(lo), float(hi)), p

    def draw(self, rng: random.Random) -> float | None:
        if self.p < 1.0 and rng.random() >= self.p:
            return None
        return rng.uniform(*self.sigma)

    def torch(self, images: Tensor, params: Sequence[Any]) -> Tensor:
        check_uint8(images, self)
        return per_sample(images, params,
                          lambda x, sigmas: gaussian_blur(x, self.kernel_size, sigmas))

    dali_inputs = {"sigma": ("FLOAT", 0)}

    def dali_values(self, params: Sequence[Any], height: int, width: int
                    ) -> dict[str, list[Any]]:
        # a sample left alone: a kernel of sigma 1e-3 weighs its centre 1 (to float32)
        return {"sigma": [np.float32(1e-3 if p is None else p) for p in params]}

    def dali(self, images: Any, inputs: dict[str, Any]) -> Any:
        from nvidia.dali import fn

        kx, ky = self.kernel_size
        return fn.gaussian_blur(images, sigma=inputs["sigma"], window_size=[ky, kx])
