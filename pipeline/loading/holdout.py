"""Holding samples out by key: an evaluation split of data too small to hold out whole shards.

A sample is held out when a stable hash of its key (blake2b, never Python's salted `hash()`)
falls in the first `percent` of 100 slots: the same split on every rank, in every process,
after a resume, and wherever the shards are moved or however they are re-sharded.

    image_loader(src, batch_size=64, holdout=KeyHoldout("train", 10))   # all but a tenth
    image_loader(src, batch_size=64, train=False,
                 holdout=KeyHoldout("eval", 10))                         # only that tenth

A loader drops the samples of the other side where its reader stage first sees them
(`Loader._check_each`, and the text loader before checking its documents), before any check:
they are not data errors and are not counted as skipped. An epoch keeps its number of reads,
so `len()` (batches per epoch) is unchanged; each batch holds only its side's samples (about
`percent`% of `batch_size` for "eval"), and can come out empty, as under on_error="skip".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from shardflow.loading.batch import EncodedBatch

Side = Literal["train", "eval"]


def held_out(key: str, percent: int) -> bool:
    """Whether the sample `key` is in the held-out `percent` of 100 hash slots."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100 < percent


@dataclass(frozen=True)
class KeyHoldout:
    """Which side of the split by key hash a loader reads: "train" (all but the held-out
    samples) or "eval" (only them); `percent` of the samples are held out."""

    side: Side
    percent: int = 10

    def __post_init__(self) -> None:
        if self.side not in ("train", "eval"):
            raise ValueError(f"side={self.side!r}: choose train or eval")
        if isinstance(self.percent, bool) or not isinstance(self.percent, int) \
                or not 0 < self.percent < 100:
            raise ValueError(f"percent={self.percent!r}: a whole number from 1 to 99")

    def keeps(self, key: str) -> bool:
        return held_out(key, self.percent) == (self.side == "eval")

    def describe(self) -> str:
        return f"{self.percent}% of samples held out by key hash"


def select(holdout: KeyHoldout | None, enc: EncodedBatch) -> None:
    """Drop from `enc` the samples that are not on `holdout`'s side (none when None): not
    data errors, so nothing is recorded in `enc.skips`."""
    if holdout is None:
        return
    for i in reversed(range(len(enc))):
        if not holdout.keeps(enc.keys[i]):
            enc.drop(i)
