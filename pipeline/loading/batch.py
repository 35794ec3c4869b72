"""What crosses module boundaries on the loading side: encoded batches and final batches.

Samples stay dicts keyed by extension until batching (see tarread); from there on a batch is a
dataclass of named fields, never a positional tuple.
"""

from __future__ import annotations

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

    def __len__(self) -> int:
        return len(self.keys)

    def drop(self, index: int) -> None:
        for column in (self.keys, self.urls, self.data, self.labels):
            del column[index]


@dataclass
class ImageBatch:
    """A batch on the target device. `keys` lets a user audit exactly what was read.

    `image` is uint8 (N, C, H, W) or (N, H, W, C) as configured, or float32 when normalized;
    `label` is int64 (N,). Under on_error="skip" a batch can be smaller than batch_size, or
    even empty (N == 0) when every sample in it was bad: every rank still runs the same
    number of batches, so a training step must accept (and may skip) an empty batch.
    """

    image: Any  # torch.Tensor
    label: Any  # torch.Tensor
    keys: list[str]

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class TextBatch:
    """Rows of `seq_len` tokens on the target device, all int64 (rows, seq_len).

    `labels` is -100 where no loss is taken: for "mlm" every position not chosen for masking,
    for "clm" only padding (labels are the tokens; the model shifts them). Padding appears only
    in the epoch's last batch (or with packing=False) and has `attention_mask` 0. `keys` are
    the documents that contributed tokens to the batch.
    """

    input_ids: Any  # torch.Tensor
    labels: Any
    attention_mask: Any
    keys: list[str]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class PointBatch:
    """Clouds on the target device: `points` float32 (N, num_points, C), `label` int64 (N,),
    `voxels` float32 (N, ...) when the loader was asked for a grid, else None."""

    points: Any  # torch.Tensor
    label: Any
    keys: list[str]
    voxels: Any = None

    def __len__(self) -> int:
        return len(self.keys)
