"""The op protocol: parameters drawn per sample in Python, applied to the batch in torch.

An op's `draw(rng)` returns what it will do to one sample (a factor, a threshold, None for
"leave it"), from that sample's generator alone, so the same sample gets the same pixels in
any batch, on any rank, after a resume. `torch(images, params)` applies a batch's parameters,
one per image, to uint8 (N, C, H, W) in one pass: per-sample values become (N, 1, 1, 1)
tensors, never a Python loop over the pixels of each image.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, overload

import torch
from torch import Tensor  # in Op, `torch` is also the method of each op


class Op:
    """One augmentation. Subclasses set `draw` and `torch`; `p` is the probability that a
    sample is changed at all (a sample it skips has the parameter None)."""

    p: float = 1.0

    def draw(self, rng: random.Random) -> Any:
        """This op's parameter for one sample; None leaves the sample as it is."""
        raise NotImplementedError

    def torch(self, images: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        """The batch with each image changed by its parameter (uint8 in, uint8 out)."""
        raise NotImplementedError

    # On the CPU: True takes the whole batch at once, not CPU_CHUNK images at a time (the
    # policies, whose ops each run on the few images that drew them).
    whole_batch = False

    # A DALI form: the per-sample inputs it reads, {name: (DALI type name, ndim)}; empty
    # for an op that has none (it then runs in torch, after the graph).
    dali_inputs: dict[str, tuple[str, int]] = {}

    def dali_values(self, params: Sequence[Any], height: int, width: int
                    ) -> dict[str, list[Any]]:
        """Per input of `dali_inputs`, one numpy value per sample (the identity where the
        parameter is None), for the graph's external sources."""
        raise NotImplementedError

    def dali(self, images: Any, inputs: dict[str, Any]) -> Any:
        """The op in a DALI graph over HWC uint8 images, its inputs' nodes given."""
        raise NotImplementedError

    def mask(self, masks: Tensor, params: Sequence[Any]) -> Tensor:
        """The images' label maps (N, K, H, W) as this op moves their pixels: unchanged for
        an op that moves none (colour ops); a geometric op warps them with the same
        parameters, nearest neighbour, 0 where nothing comes in."""
        return masks

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def span(value: Any, op: object, name: str, *, centre: float = 0.0,
         low: float | None = None) -> tuple[float, float]:
    """A range in either of torchvision's forms: a number x, meaning centre - x .. centre + x
    (not below `low`), or a (min, max) pair. Anything else is refused, showing both."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        bottom = centre - value if low is None else max(low, centre - value)
        return float(bottom), float(centre + value)
    if isinstance(value, tuple | list) and len(value) == 2 and \
            all(isinstance(v, int | float) and not isinstance(v, bool) for v in value) and \
            value[0] <= value[1] and (low is None or value[0] >= low):
        return float(value[0]), float(value[1])
    raise ValueError(f"{type(op).__name__}({name}={value!r}): give a number x >= 0 (the range "
                     f"{centre:g} - x .. {centre:g} + x) or a (min, max) pair, as torchvision "
                     "takes it")


def sample_rngs(seed: int, epoch: int, keys: Sequence[str]) -> list[random.Random]:
    """One generator per sample for the ops, apart from the crop's (shardflow.loading.rng):
    adding an op changes no crop window."""
    return [random.Random(f"ops/{seed}/{epoch}/{key}") for key in keys]


# Images a CPU batch is augmented by at a time: an op's float temporaries for 4 images of
# 224 (2.4 MB) stay in the cache, where a whole batch's (38 MB at 64) go through memory.
# Measured over 64 images of 224, one thread, ms an image: ColorJitter(0.4, 0.4, 0.4, 0.1)
# 8.7 whole, 5.7 by 4, 4.6 one by one; RandAugment(2, 9) 1.1 either way. The same pixels
# whatever the chunk (tests/test_ops.py).
CPU_CHUNK = 4


@overload
def apply(ops: Sequence[Op], images: torch.Tensor, rngs: Sequence[random.Random],
          masks: None = None, done: int = 0) -> torch.Tensor: ...
@overload
def apply(ops: Sequence[Op], images: torch.Tensor, rngs: Sequence[random.Random],
          masks: torch.Tensor, done: int = 0) -> tuple[torch.Tensor, torch.Tensor]: ...
def apply(ops: Sequence[Op], images: torch.Tensor, rngs: Sequence[random.Random],
          masks: torch.Tensor | None = None, done: int = 0) -> Any:
    """Each op in turn over the batch, its parameters drawn from each sample's generator in
    op order (so a sample's draws do not depend on its batch). On the CPU the batch goes
    through the ops CPU_CHUNK images at a time, but for those that take it whole
    (Op.whole_batch); each image's pixels are its own whatever it is batched with. A GPU
    takes the whole batch in each op. With `masks` (N, K, H, W)
    label maps of the images: (images, masks), each op's geometry applied to both. `done`:
    the leading ops already applied (in a DALI graph, from these draws): drawn, not run."""
    if len(rngs) != len(images):
        raise ValueError(f"{len(rngs)} generators for a batch of {len(images)} images")
    if masks is not None and (masks.dim() != 4 or len(masks) != len(images)
                              or masks.shape[-2:] != images.shape[-2:]):
        raise ValueError(f"masks {tuple(masks.shape)} for images {tuple(images.shape)}: "
                         "need (N, K, H, W) of the images' N, H, W")
    params = [[op.draw(rng) for rng in rngs] for op in ops][done:]
    ops = ops[done:]
    cpu = images.device.type == "cpu"
    start = 0
    while start < len(ops):  # each run of ops that take the same chunks
        whole = not cpu or ops[start].whole_batch
        end = start + 1
        while end < len(ops) and (not cpu or ops[end].whole_batch) == whole:
            end += 1
        images, masks = _chunked(ops[start:end], images, masks, params[start:end],
                                 max(len(images), 1) if whole else CPU_CHUNK)
        start = end
    return images if masks is None else (images, masks)


def _chunked(ops: Sequence[Op], images: torch.Tensor, masks: torch.Tensor | None,
             params: Sequence[Sequence[Any]], step: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`ops` over the batch `step` images at a time."""
    parts = [_through(ops, images[i:i + step], None if masks is None else masks[i:i + step],
                      [p[i:i + step] for p in params])
             for i in range(0, max(len(images), 1), step)]
    if len(parts) == 1:
        return parts[0]
    return (torch.cat([p[0] for p in parts]),
            None if masks is None else torch.cat([p[1] for p in parts if p[1] is not None]))


def _through(ops: Sequence[Op], images: torch.Tensor, masks: torch.Tensor | None,
             params: Sequence[Sequence[Any]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    for op, drawn in zip(ops, params, strict=True):
        images = op.torch(images, drawn)
        if masks is not None:
            masks = op.mask(masks, drawn)
    return images, masks


def on_device(values: Any, device: torch.device, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """A tensor of Python values on `device`. To a GPU through pinned memory, without
    blocking: a copy from pageable memory would wait for the stream, a host sync in the
    training step."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) and dtype is not None else \
        values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def chosen(params: Sequence[Any]) -> list[int]:
    """The samples an op changes (its parameter is not None)."""
    return [i for i, p in enumerate(params) if p is not None]


def per_sample(images: torch.Tensor, params: Sequence[Any], fn: Any) -> torch.Tensor:
    """`fn(images[idx], values)` over the samples with a parameter, values a float32
    (n, 1, 1, 1) tensor on the images' device; the others stay as they are."""
    idx = chosen(params)
    if not idx:
        return images
    values = on_device([float(params[i]) for i in idx], images.device, torch.float32)
    values = values.view(-1, 1, 1, 1)
    if len(idx) == len(images):
        return fn(images, values)
    return put_rows(images.clone(), idx, fn(rows(images, idx), values))


def rows(images: torch.Tensor, idx: Sequence[int]) -> torch.Tensor:
    """images[idx], the batch's images `idx` (a list): on the CPU a cat of their views
    (advanced indexing over a channels-last batch, as a loader's is, measured 17x slower:
    1.6 ms for 9 images of 224), on a GPU one index on the device."""
    if images.device.type == "cpu":
        return torch.cat([images[i:i + 1] for i in idx])
    return images[on_device(list(idx), images.device)]


def put_rows(out: torch.Tensor, idx: Sequence[int], values: torch.Tensor) -> torch.Tensor:
    """out[idx] = values, in place, and `out`: on the CPU an image at a time (each a
    contiguous copy, as `rows`), on a GPU one index."""
    if out.device.type == "cpu":
        for k, i in enumerate(idx):
            out[i].copy_(values[k])
    else:
        out[on_device(list(idx), out.device)] = values
    return out


def through_lut(images: torch.Tensor, luts: torch.Tensor) -> torch.Tensor:
    """uint8 (N, C, H, W) through lookup tables `luts` (N or 1, C or 1, 256) uint8: one table
    per image and channel, for the ops that map each value alone (brightness, contrast,
    solarize, autocontrast, equalize). On the CPU numpy's take with the uint8 pixels as
    indices (measured 4x faster than the same ops in float over a 224 batch, 7x than
    torch.where, with no int64 copy of the pixels): a table for every channel takes each
    image's pixels in their own memory order at once, a table per channel each plane.
    Elsewhere a gather. The table is the op's own float maths over 0..255, so the pixels are
    the same either way."""
    n, c = images.shape[:2]
    if images.device.type != "cpu":
        flat = images.reshape(n, c, -1).long()
        return luts.expand(n, c, 256).gather(2, flat).reshape(images.shape)
    import numpy as np

    if luts.shape[1] == 1 and images.permute(0, 2, 3, 1).is_contiguous():  # channels last
        src = images.permute(0, 2, 3, 1).numpy()
        out = torch.empty(src.shape, dtype=torch.uint8)
        tables, dst = luts.expand(n, 1, 256).contiguous().numpy(), out.numpy()
        for i in range(n):
            np.take(tables[i, 0], src[i], out=dst[i])
        return out.permute(0, 3, 1, 2)
    luts = luts.expand(n, c, 256)
    out = torch.empty(images.shape, dtype=torch.uint8)
    src, dst, tables = images.contiguous().numpy(), out.numpy(), luts.contiguous().numpy()
    for i in range(n):
        for j in range(c):
            np.take(tables[i, j], src[i, j], out=dst[i, j])
    return out


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Float values already in 0..255 (clamped, or a blend of levels) to uint8, truncated as
    torch's cast truncates. On the CPU through int32: torch's direct float-to-uint8 cast is
    not vectorized there (93 us for an image of 224 against 37 through int32, the same
    values); on a GPU the direct cast."""
    if x.device.type == "cpu":
        x = x.to(torch.int32)
    return x.to(torch.uint8)


def levels(images: torch.Tensor) -> torch.Tensor:
    """The 256 values as float32 (1, 1, 256) on the images' device, for building tables."""
    return torch.arange(256, dtype=torch.float32, device=images.device).view(1, 1, 256)


def check_uint8(images: torch.Tensor, op: Op) -> None:
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"{op!r} takes uint8 images (N, 1 or 3, H, W), not "
                         f"{images.dtype} {tuple(images.shape)}")
