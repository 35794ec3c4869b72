"""What crosses module boundaries on the loading side: encoded batches and final batches.

Samples stay dicts keyed by extension until batching (see tarread); from there on a batch is a
dataclass of named fields, never a positional tuple.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class EncodedBatch:
    """Up to batch_size samples as read from shards, not yet decoded.

    `state` is the reader's position right after this batch: loading it into a new reader
    continues with the batch that followed this one.
    """

    keys: list[str]
    urls: list[str]
    data: list[np.ndarray]  # the encoded image (or document, or cloud) bytes, uint8 1-D
    labels: list[bytes | None]  # raw `.cls` members; None where the sample has none
    state: dict[str, Any] = field(default_factory=dict)
    skips: list[dict[str, str]] = field(default_factory=list)  # dropped on the way here
    # Members asked for besides data and label, by extension: a column aligned with `keys`
    # of the raw bytes (None where the sample has none), which the loader's check replaces
    # by each one's parsed value (str, a JSON object...).
    extras: dict[str, list[Any]] = field(default_factory=dict)
    # `data` as the reader had it, one buffer and each sample's size (DALI's and the index
    # reader), for a consumer that takes the whole column at once (text/pretokenized.py);
    # None once a sample is dropped, or from a reader that has none. A reader asked for no
    # views leaves `data` empty beside it, until `unpack()`.
    flat: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def unpack(self) -> None:
        """Fill an empty `data` with its samples' views of `flat` (a consumer that looks at
        samples alone, when the reader was asked for the buffer only)."""
        if self.flat is not None and len(self.data) != len(self.keys):
            buffer, sizes = self.flat
            ends = np.cumsum(sizes).tolist()
            self.data = [buffer[end - size: end]
                         for size, end in zip(sizes.tolist(), ends, strict=True)]

    def drop(self, index: int) -> None:
        self.unpack()
        columns: list[list[Any]] = [self.keys, self.urls, self.data, self.labels]
        for column in columns + list(self.extras.values()):
            del column[index]
        self.flat = None


@dataclass
class ImageBatch:
    """A batch on the target device. `keys` lets a user audit exactly what was read.

    `image` is uint8 (N, C, H, W) or (N, H, W, C) as configured, or float32 when normalized;
    `label` is int64 (N,), or None from a loader built with labels=False; `extras` maps each
    extension asked for (extras=("txt", "json")) to N values: str for text, the parsed
    object for JSON, bytes otherwise (None when none were asked for). Under on_error="skip"
    a batch can be smaller than batch_size, or even empty (N == 0) when every sample in it
    was bad: every rank still runs the same number of batches, so a training step must
    accept (and may skip) an empty batch. `target` is float32 (N, classes), soft targets
    whose rows sum to 1, from a loader built with batch_augment (mixup, cutmix); else None.
    `views`: from a loader built with views (image/views.py), one tensor (N, C, h, w) per
    view, each at its view's size; `image` is the first of them. Else None. `targets`: from
    a loader built with targets={"mask": "seg.png"}, each name's label maps (N, H, W), uint8
    (int32 for 16-bit masks), cropped, flipped and warped exactly as the images are.
    """

    image: Any  # torch.Tensor
    label: Any  # torch.Tensor, or None (labels=False)
    keys: list[str]
    extras: dict[str, list[Any]] | None = None
    target: Any = None  # torch.Tensor (N, classes), or None (no batch_augment)
    views: list[Any] | None = None  # a loader with views: one tensor per view (image: the first)
    targets: dict[str, Any] | None = None  # a loader with targets: name -> (N, H, W)

    def __iter__(self) -> Iterator[Any]:
        """`images, labels = batch`, as a (image, label) DataLoader batch unpacks; the soft
        targets in place of the labels where batch_augment made them."""
        return iter((self.image, self.label if self.target is None else self.target))

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class TextBatch:
    """Rows of `seq_len` tokens on the target device, all int64 (rows, seq_len).

    `labels` is -100 where no loss is taken: for "mlm" every position not chosen for masking,
    for "clm" only padding (labels are the tokens; the model shifts them). Padding appears only
    in the epoch's last batch (or with packing=False) and has `attention_mask` 0. `keys` are
    the documents that contributed tokens to the batch. With packing=False a batch has 0 rows
    where all of its read's documents were skipped (`len(batch) == 0`).
    """

    input_ids: Any  # torch.Tensor
    labels: Any
    attention_mask: Any
    keys: list[str]

    def __iter__(self) -> Iterator[Any]:
        """`tokens, labels = batch`, as Hugging Face's (input_ids, labels) pairs unpack."""
        return iter((self.input_ids, self.labels))

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class PointBatch:
    """Clouds on the target device: `points` float32 (N, num_points, C), `label` int64 (N,),
    `voxels` float32 (N, ...) when the loader was asked for a grid, else None. `offset` is
    float64 (N, 3): what make_shards took from the x, y, z of a cloud far from the origin
    (geographic coordinates) to keep float32 precise, zeros for the others. The points are
    relative to it: with normalize=False and no augmentation, points[..., :3] (as float64)
    + offset[:, None] are the file's coordinates."""

    points: Any  # torch.Tensor
    label: Any
    keys: list[str]
    voxels: Any = None
    offset: Any = None  # torch.Tensor float64 (N, 3)

    def __iter__(self) -> Iterator[Any]:
        """`points, labels = batch` (the voxels in place of the points where asked for)."""
        return iter((self.points if self.voxels is None else self.voxels, self.label))

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class ScanBatch:
    """Scenes with a label per point (LiDAR segmentation: pointcloud_loader(...,
    per_point_labels=True)), ragged: frames differ in size, so their points are concatenated.

    - `points` float32 (P, 3): x, y, z in metres of every frame's points, frame after frame;
      `offsets` int64 (B + 1,): frame b is rows offsets[b]:offsets[b + 1].
    - `labels` int64 (P,): each point's class; `ignore_label` marks unlabelled points.
    - With a voxel grid (the loader's `voxel_size`): `voxel_coords` int64 (V, 4) of
      (frame, ix, iy, iz) per occupied voxel, `voxel_labels` int64 (V,) (the majority of its
      labelled points; ignore_label when none is), `voxel_counts` int64 (V,) points per
      voxel, `point_voxel` int64 (P,) each point's voxel row, -1 for a point outside the
      grid: logits per voxel projected back to the points are `logits[point_voxel]`.
      `grid` is (X, Y, Z), cells per axis. All None without a grid.
    - `offset` float64 (B, 3): make_shards's offset of each frame (zeros for most).
    """

    points: Any  # torch.Tensor
    offsets: Any
    labels: Any
    keys: list[str]
    ignore_label: int = 255
    voxel_coords: Any = None
    voxel_labels: Any = None
    voxel_counts: Any = None
    point_voxel: Any = None
    grid: tuple[int, int, int] | None = None
    offset: Any = None

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class TabularBatch:
    """Rows of tabular (click-through-rate) data on the target device: `dense` float32 (N, D),
    the numeric fields after the loader's transforms (missing filled, log1p, clipped);
    `sparse` int64 (N, F), each categorical field's id in [0, num_buckets[f]) (hashed, or a
    vocabulary id); `label` float32 (N,) in {0, 1}. `keys` name each row as
    "<block key>:<row in block>", so a run can audit exactly which rows it read."""

    dense: Any  # torch.Tensor
    sparse: Any
    label: Any
    keys: list[str]

    def __len__(self) -> int:
        return len(self.keys)

