"""The tabular loader's options: the shared loader options plus hashing and dense transforms,
and the schema a loader reports (what a model sizes its embedding tables by)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardflow.loading.options import LoaderOptions, choice, positive
from shardflow.tabular.dense import TRANSFORMS, DenseTransform

MAX_BUCKETS = 2**32  # ids scale the hash's high 32 bits (hashing.py)


@dataclass(frozen=True)
class TabularConfig(LoaderOptions):
    """Options of `tabular_loader`; every field is also a keyword argument of it.

    `batch_size` counts rows. `shuffle_buffer` (training only) is how many rows are mixed
    together: the reader's blocks are taken a window of about that many rows at a time
    (whole blocks, at least one) and the window's rows permuted, from (seed, epoch, the
    window's first block); without shuffling a read is about `batch_size` rows.
    `block_shuffle_buffer` is the reader's own buffer of blocks, shuffled within shards.
    Memory: about two windows of decoded rows are held at once, plus the reader's blocks.
    """

    shuffle_buffer: int = 65536
    num_buckets: int | tuple[int, ...] = 2**18  # per categorical field (one int: all fields)
    hash_seed: int = 0  # the hash's seed: keep it fixed between training and evaluation
    dense_transform: DenseTransform = "log1p"
    fill: float = 0.0  # what a missing dense value becomes (after the transform)
    clip: tuple[float, float] | None = None  # (low, high) applied after the transform
    block_shuffle_buffer: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        choice(self, "dense_transform", TRANSFORMS)
        buckets = self.num_buckets
        if not isinstance(buckets, int):
            object.__setattr__(self, "num_buckets", buckets := tuple(buckets))
        for b in (buckets,) if isinstance(buckets, int) else buckets:
            if isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= MAX_BUCKETS:
                raise ValueError(f"num_buckets={self.num_buckets!r}: each from 2 (id 0 is "
                                 f"kept for missing values) to 2**32")
        if not math.isfinite(self.fill):
            raise ValueError(f"fill={self.fill}: a finite number")
        if self.clip is not None:
            object.__setattr__(self, "clip", clip := tuple(map(float, self.clip)))
            if len(clip) != 2 or not clip[0] <= clip[1]:
                raise ValueError(f"clip={self.clip}: (low, high) with low <= high, or None")
        positive(self, "block_shuffle_buffer")


@dataclass
class FeatureSchema:
    """What the loader yields: `dense` columns in the order of TabularBatch.dense's columns,
    `categorical` in the order of TabularBatch.sparse's, and each categorical field's id
    count (`num_buckets[f]`: ids are in [0, num_buckets[f]), 0 meaning missing)."""

    label: str
    dense: list[str]
    categorical: list[str]
    num_buckets: list[int]
    rows: int | None = None  # rows in the source, from its manifest (None: unknown)
    rows_per_block: int | None = None
