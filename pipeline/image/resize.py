"""Resizing decoded images on the CPU with torch's vectorised uint8 kernels.

Measured here (2 cores, photo-like JPEGs, crops of ~300 px to 224): DALI's CPU resize with
antialiasing cost about as much as the region-of-interest decode itself (0.6-0.8 ms a crop),
torch's antialiased bilinear uint8 kernel about 0.3 ms. So on the CPU the DALI graph only
decodes, and this stage resizes, flips and lays out the batch; on a GPU the graph does it all.
The filter is the same (bilinear, antialiased when shrinking), as in torchvision.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def _resize(hwc: np.ndarray, height: int, width: int) -> torch.Tensor:
    """(1, 3, height, width) uint8 from an HWC uint8 image, without copying the input."""
    chw = torch.from_numpy(hwc).permute(2, 0, 1).unsqueeze(0)  # channels-last strides
    return F.interpolate(chw, size=(height, width), mode="bilinear", antialias=True,
                         align_corners=False)


def batch(images: Sequence[np.ndarray], flips: Sequence[bool], size: int,
          channels_first: bool, normalize: tuple[Sequence[float], Sequence[float]] | None,
          turns: Sequence[tuple[bool, bool]] | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """Each decoded window resized to size x size and flipped where asked, as one batch:
    uint8, or float32 (x - mean) / std when `normalize` gives (mean, std) in 0..255 units.
    `turns`: per image (transpose, vertical flip), applied before the horizontal flip: what
    turns a window decoded as stored upright (EXIF orientation, see augment.to_stored).
    `out`: where to write the batch (see `batch_shape`), e.g. a buffer of a HostPool.

    One pass per image, while its 224 x 224 pixels are in the cache: resize (uint8), then
    convert and normalize into the batch. Normalizing the whole batch afterwards read and
    wrote its 38 MB twice more (measured 2x slower per batch)."""
    shape, dtype = batch_shape(len(images), size, channels_first, normalize is not None)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype}, want {shape} {dtype}")
    mean = std = None
    if normalize:
        mean, std = (torch.tensor(v, dtype=torch.float32).view(3, 1, 1) for v in normalize)
    chw = out if channels_first else out.permute(0, 3, 1, 2)  # a view: NHWC written in place
    # Normalizing a channels-last view in place ran 3x slower (strided broadcasts): NHWC
    # is normalized in a contiguous scratch image, then copied into its slot.
    scratch = None if channels_first or mean is None else torch.empty((3, size, size))
    for i, (image, flip) in enumerate(zip(images, flips, strict=True)):
        transpose, vflip = turns[i] if turns is not None else (False, False)
        one = chw[i] if scratch is None else scratch
        one.copy_(_orient(_resize(image, size, size)[0], transpose, vflip, flip))
        if mean is not None and std is not None:
            one.sub_(mean).div_(std)  # the same operations as torchvision's Normalize
            if scratch is not None:
                chw[i].copy_(scratch)
    return out


def batch_shape(count: int, size: int, channels_first: bool, normalized: bool
                ) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of `batch`'s output."""
    shape = (count, 3, size, size) if channels_first else (count, size, size, 3)
    return shape, torch.float32 if normalized else torch.uint8


def _orient(chw: torch.Tensor, transpose: bool, vflip: bool, hflip: bool) -> torch.Tensor:
    # On the square output, not the window: the same pixels (both axes resize to `size` with
    # the same symmetric filter, so transposing and flipping commute with the resize), at the
    # cost of one size x size image at most.
    if transpose:
        chw = chw.transpose(1, 2)
    dims = [dim for dim, on in ((1, vflip), (2, hflip)) if on]
    return chw.flip(dims) if dims else chw


def mask_batch(crops: Sequence[np.ndarray], turns: Sequence[tuple[bool, bool, bool]],
               size: int) -> torch.Tensor:
    """Each mask window (H, W), as stored, resized to size x size by nearest neighbour (the
    pixel centres the image's resize maps: a label is never blended into another) and turned
    and flipped as its image is (transpose, vflip, hflip): int64 (N, size, size), what
    F.cross_entropy takes, whatever the masks' bit depth (one dtype every batch)."""
    out = torch.empty((len(crops), size, size), dtype=torch.int64)
    for i, (crop, (transpose, vflip, hflip)) in enumerate(zip(crops, turns, strict=True)):
        one = torch.from_numpy(crop)[None, None]
        if one.dtype != torch.uint8:  # torch's nearest takes no int32: float holds 16 bits
            one = one.float()
        one = F.interpolate(one, size=(size, size), mode="nearest-exact")
        out[i] = _orient(one[0], transpose, vflip, hflip)[0]
    return out


def values_batch(crops: Sequence[np.ndarray], turns: Sequence[tuple[bool, bool, bool]],
                 size: int) -> torch.Tensor:
    """`mask_batch` for maps of continuous values (depth): bilinear (antialiased where it
    shrinks, as the images are), float32 (N, size, size)."""
    out = torch.empty((len(crops), size, size), dtype=torch.float32)
    for i, (crop, (transpose, vflip, hflip)) in enumerate(zip(crops, turns, strict=True)):
        one = torch.from_numpy(crop)[None, None]
        one = F.interpolate(one, size=(size, size), mode="bilinear", align_corners=False,
                            antialias=True)
        out[i] = _orient(one[0], transpose, vflip, hflip)[0]
    return out


def views(tensor_list: Any) -> list[np.ndarray]:
    """Per-sample numpy views of a CPU DALI TensorList (valid until its pipeline runs again)."""
    return [np.asarray(tensor_list[i]) for i in range(len(tensor_list))]
